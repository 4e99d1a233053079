"""KV capacity of the sliding-window families from their configs alone: ringserve and vLLM.

No weights are read: each model is a transformers config written here with the published
shape of a checkpoint (the values are printed), turned into ringserve's `KVCacheSpec` by the
same code that serves it (`engine.kv_cache.kv_cache_spec`). For 2 GiB of bf16 KV and block
16, per request length (prompt + max_tokens):

- *bytes allow*: 2 GiB over one request's K and V counted per layer and token (a sliding
  layer keeps at most ``w`` tokens; Gemma 4's KV-sharing layers keep none).
- *ringserve*: sequences its exact admission holds at once, with prefix caching (each ring
  keeps ``b - 1`` tokens of slack) and without.
- *vLLM*: what its hybrid allocator holds per sequence while decoding, written out from
  its rules (not run): layers grouped as many to a group as the smallest kind has, a full
  group ``cdiv(n, b)`` blocks, a sliding group ``cdiv(w - 1, b) + 1`` once the blocks
  before the window are freed (during a prefill chunk it holds more, and its admission is
  not exact: it preempts when the pool runs out). A model with two KV shapes (Gemma 4) is
  left out: vLLM equalises its groups' page sizes another way (other block sizes), which
  this does not model. The "Maximum concurrency" vLLM's CPU build logs for gemma-3-270m
  is measured in `benchmarks/capacity.py`.

gpt-oss-20b: the goal of issue 24 is 9 blocks of 16 a sliding layer with prefix caching
(``ceil((128 + 15) / 16)``), 8 without, and its full layers growing.

    .venv/bin/python benchmarks/capacity_families.py  # seconds; results/capacity_families.md
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

from ringserve.block_manager import KVCacheSpec, plan_num_blocks, sequences_that_fit  # noqa: E402
from ringserve.engine.kv_cache import kv_cache_spec  # noqa: E402
from ringserve.engine.models import model_config_from_hf  # noqa: E402

MEMORY = 2 * 2**30
BLOCK = 16
LENGTHS = (256, 4096, 32768)


def _alternating(n: int, every: int) -> list[str]:
    """Layer types with a full layer every ``every`` layers (the last of each run)."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]


MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # openai/gpt-oss-20b's config.json
    "gpt-oss-20b": ("GptOssConfig", dict(
        hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, sliding_window=128, intermediate_size=2880, num_local_experts=32,
        num_experts_per_tok=4, vocab_size=201088, max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"] * 12,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0})),
    # Gemma-4-E2B-shaped: 35 layers, a full one every 5th, 1 KV head of 256 (512 on full
    # layers), the last 20 layers reading the K/V of earlier ones
    "gemma-4-e2b-shaped": ("Gemma4TextConfig", dict(
        hidden_size=1536, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
        head_dim=256, global_head_dim=512, sliding_window=512, num_kv_shared_layers=20,
        intermediate_size=6144, layer_types=_alternating(35, 5),
        max_position_embeddings=131072)),
    # google/gemma-3-270m, for scale (benchmarks/capacity.py measures it end to end)
    "gemma-3-270m": ("Gemma3TextConfig", dict(
        hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, sliding_window=512, intermediate_size=2048, vocab_size=262144,
        layer_types=_alternating(18, 6), max_position_embeddings=32768)),
}


def spec_of(name: str, caching: bool) -> KVCacheSpec:
    class_name, kwargs = MODELS[name]
    hf = getattr(transformers, class_name)(**kwargs)
    return kv_cache_spec(model_config_from_hf(hf), BLOCK, torch.bfloat16,
                         prefix_caching=caching)


def bytes_allow(spec: KVCacheSpec, n: int) -> int:
    per = sum(len(g.layer_ids) * g.row * 2 * spec.dtype_bytes
              * (n if g.window is None else min(n, g.window)) for g in spec.groups)
    return MEMORY // per


def vllm_decoding(spec: KVCacheSpec, n: int) -> int | None:
    """Sequences of ``n`` tokens vLLM's allocator holds while decoding (None: a model of
    two KV shapes, not modelled)."""
    if not spec.uniform:
        return None
    layers: dict[int | None, int] = {}
    for g in spec.groups:
        layers[g.window] = layers.get(g.window, 0) + len(g.layer_ids)
    per_group = min(layers.values())
    page = 2 * BLOCK * spec.groups[0].row * spec.dtype_bytes
    num_blocks = MEMORY // (page * per_group)
    held = sum(-(-count // per_group) * (-(-n // BLOCK) if w is None else
                                          min(-(-(w - 1) // BLOCK) + 1, -(-n // BLOCK)))
               for w, count in layers.items())
    return num_blocks // held


def main() -> None:
    lines = [f"2 GiB of bf16 KV, block {BLOCK} (`benchmarks/capacity_families.py`; vLLM "
             "counted from its allocator's rules, not run)", ""]
    for name in MODELS:
        cached, plain = spec_of(name, True), spec_of(name, False)
        blocks = plan_num_blocks(cached, MEMORY)
        lines.append(f"### {name}")
        lines.append("")
        for g in dict.fromkeys((g.name, g.num_kv_heads, g.head_dim) for g in cached.groups):
            members = [i for i, x in enumerate(cached.groups)
                       if (x.name, x.num_kv_heads, x.head_dim) == g]
            ring = cached.ring_blocks(members[0])
            layers = sum(len(cached.groups[i].layer_ids) for i in members)
            lines.append(f"- {g[0]}: {layers} layers of {g[1]} x {g[2]}, "
                         + (f"rings of {ring} blocks ({plain.ring_blocks(members[0])} "
                            "without prefix caching)" if ring else "growing"))
        lines.append(f"- one block: {cached.block_bytes // 1024} KiB; {blocks} blocks")
        lines += ["", "| tokens | bytes allow | ringserve | ringserve, no prefix caching | "
                      "vLLM (decoding) | ringserve / vLLM |",
                  "|" + "---|" * 6]
        for n in LENGTHS:
            ours = sequences_that_fit(cached, blocks, n)
            ours_plain = sequences_that_fit(plain, plan_num_blocks(plain, MEMORY), n)
            v = vllm_decoding(cached, n)
            vcols = "- | -" if v is None else f"{v} | {ours / v:.2f}x"
            lines.append(f"| {n:,} | {bytes_allow(cached, n)} | {ours} | {ours_plain} | "
                         f"{vcols} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    out = ROOT / "benchmarks" / "results" / "capacity_families.md"
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
