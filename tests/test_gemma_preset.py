"""The real sliding-window model: gemma-3-270m (window 512, five sliding : one full).

A prompt longer than the window plus 200 greedy tokens, through our model over ring KV
caches (NaN-poisoned, every read checked against a shadow of slot owners), must be
token-identical to transformers' ``generate`` on the same GGUF file (which it dequantizes
itself), in float32.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.model_harness import RingHarness, load_ours
from tests.presets import preset_path, transformers_from_gguf

STORY = (
    "Once upon a time, there was a little girl named Lily who lived in a small house at the "
    "edge of a great forest. Every morning she walked to the river with her grandmother to "
    "fetch water, and every evening they sat by the fire and told each other stories about "
    "the animals they had seen: a fox with a white tail, an owl that never slept, and a "
    "family of deer that drank from the river at dawn. "
)


@pytest.mark.slow
def test_gemma_270m_past_the_window_matches_transformers() -> None:
    path = preset_path("gemma-3-270m")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tokenizer(STORY * 8 + "One day, Lily")["input_ids"]
    assert len(prompt) > 512 + 64  # the ring has wrapped before the first new token
    new = 200
    ref = transformers_from_gguf("gemma-3-270m")
    assert ref.config.sliding_window == 512
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)
    expected = out[0, len(prompt):].tolist()
    del ref
    harness = RingHarness(load_ours(str(path)), 16, len(prompt) + new)
    assert harness.windows == [512] * 5 + [None]  # five sliding groups of 3 layers, one full
    assert harness.greedy(prompt, new) == expected
    stats = harness.kv.stats()
    assert stats.ring_slot_overwrites > 0 and stats.read_misses == 0


@pytest.mark.slow
def test_gemma_270m_served_from_its_gguf_blocks() -> None:
    """`--quantization gguf` (the default on a bf16 CPU): the Q4_K_M file's own blocks,
    repacked, against transformers' float32 dequantization of the same file, teacher-forced
    past the window. Each tensor keeps its block type's layout (Q8_0 and Q5_0 as int8 per
    32, Q6_K as int8 per 16, Q4_K as 4-bit per 32)."""
    from ringserve.engine.loading import load_model
    from ringserve.engine.loading.quantize import weight_bytes
    from ringserve.engine.models.quant_linear import QuantEmbedding, QuantLinear
    from tests.model_harness import teacher_forced_logits

    path = preset_path("gemma-3-270m")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer(STORY * 8)["input_ids"][:600]
    ref = transformers_from_gguf("gemma-3-270m")
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0, :-1]
    del ref
    model = load_model(path, dtype=torch.bfloat16, quantization="gguf")
    layer = model.model.layers[0]
    kinds = {name: (m.bits, m.group) for name, m in [
        ("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
        ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj),
        ("head", model.lm_head)] if isinstance(m, QuantLinear)}
    assert kinds == {"qkv": (8, 32), "o": (4, 32), "gate_up": (8, 32), "down": (8, 16),
                     "head": (8, 32)}
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert weight_bytes(model).per_token < 0.6 * 268_098_176 * 2  # bf16 reads 536 MB
    got = teacher_forced_logits(model, ids, 256, 16)[:-1]
    targets = torch.tensor(ids[1:])
    top1 = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    nll = torch.nn.functional.cross_entropy
    ratio = torch.exp(nll(got.float(), targets) - nll(expected, targets)).item()
    assert top1 >= 0.95 and abs(ratio - 1) < 0.02, (top1, ratio)
