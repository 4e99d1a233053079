"""Big models at their real shapes: the memory and speed a user meets (issue 66).

No real big weights can be downloaded here, so this makes checkpoints with random weights at
a published model's real config (full width, fewer layers) in that model's published format,
and serves them:

    python benchmarks/real_shapes.py make gpt-oss-20b --layers 4 --out /tmp/gpt-oss-4
    python benchmarks/real_shapes.py serve /tmp/gpt-oss-4 --kv-cache-memory 256MiB
    python benchmarks/real_shapes.py gguf /tmp/gpt-oss-4 --outtype q8_0 --out /tmp/g.gguf
    python benchmarks/real_shapes.py serve /tmp/g.gguf --kv-cache-memory 256MiB
    python benchmarks/real_shapes.py serve /tmp/g.gguf --server llamacpp -- -c 16384 -np 4
    python benchmarks/real_shapes.py plan gpt-oss-20b      # what every layer count needs

`make` writes the folder one tensor at a time (never the whole model in memory): gpt-oss-20b
as openai publishes it (MXFP4 expert blocks and scales, bf16 attention, router, embedding and
head), Gemma 3 12B's text model in bf16. `serve` starts `ringserve serve` on it and prints:
the start time (until /health says ready), the peak and serving RSS of the server's
processes (API + engine core, from /proc: VmHWM and VmRSS), the bytes a decode step reads
(the engine's own count) against the machine's read limit, and TPOT at 1, 4 and 16 streams.
`gguf` converts a folder with llama.cpp's own `convert_hf_to_gguf.py` (its tokenizer step
steered as `tests/llamacpp_convert.py` explains); `serve --server llamacpp` measures
llama.cpp's `llama-server` (built by `benchmarks/peers/setup_llamacpp.py`, 2 threads) on the
same file the same way: the same requests, the same RSS meter (llama.cpp's RSS includes the
file pages it maps, which are its weights). `plan` prints what every layer count up to the
model's full one needs (weights as a CPU serves them, bf16 KV for 4 sequences of 8,192
tokens), from the config alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ringserve  # noqa: E402,F401  (first: the repository's kernels/ must not hide HF's)


def _gemma3(**shape: Any) -> dict[str, Any]:
    """A Gemma 3 text model's published config: its shape, and what every size shares."""
    layers = shape["num_hidden_layers"]
    return dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                sliding_window=1024, vocab_size=262208, max_position_embeddings=131072,
                rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                rope_scaling={"rope_type": "linear", "factor": 8.0}, torch_dtype="bfloat16",
                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                             for i in range(layers)], **shape)


# The published configs (text models), less what the loaders fill in by default.
MODELS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        sliding_window=128, intermediate_size=2880, num_local_experts=32,
        num_experts_per_tok=4, experts_per_token=4, vocab_size=201088,
        max_position_embeddings=131072, attention_bias=True, rms_norm_eps=1e-5,
        tie_word_embeddings=False, torch_dtype="bfloat16", swiglu_limit=7.0,
        layer_types=["sliding_attention", "full_attention"] * 12,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096},
        rope_theta=150000.0,
        quantization_config={"quant_method": "mxfp4",
                             "modules_to_not_convert": ["model.layers.*.self_attn",
                                                        "model.layers.*.mlp.router",
                                                        "model.embed_tokens", "lm_head"]}),
    "gemma-3-12b": _gemma3(hidden_size=3840, num_hidden_layers=48, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=256, intermediate_size=15360,
                           query_pre_attn_scalar=256),
    "gemma-3-27b": _gemma3(hidden_size=5376, num_hidden_layers=62, num_attention_heads=32,
                           num_key_value_heads=16, head_dim=128, intermediate_size=21504,
                           query_pre_attn_scalar=168),
}


def config_for(name: str, layers: int | None) -> dict[str, Any]:
    cfg = json.loads(json.dumps(MODELS[name]))
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        cfg["layer_types"] = cfg["layer_types"][:layers]
    return cfg


# -- make ------------------------------------------------------------------------------------


def tensor_shapes(cfg: dict[str, Any]) -> list[tuple[str, list[int], str]]:
    """(name, shape, safetensors dtype) of every tensor the published checkpoint stores,
    from transformers' own model built on the meta device (nothing allocated)."""
    import torch
    import transformers

    hf = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                             if k not in ("architectures",
                                                          "quantization_config")})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    out: list[tuple[str, list[int], str]] = []
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and hf.tie_word_embeddings:
            continue  # the embedding, stored once
        shape = list(param.shape)
        if cfg["model_type"] == "gpt_oss" and re.search(r"experts\.(gate_up|down)_proj$", name):
            experts, k, n = shape  # transformers' [experts, in, out]; stored [E, out, in/32, 16]
            out.append((name + "_blocks", [experts, n, k // 32, 16], "U8"))
            out.append((name + "_scales", [experts, n, k // 32], "U8"))
        else:
            out.append((name, shape, "BF16"))
    return out


def _fill(name: str, shape: list[int], dtype: str, seed: int) -> bytes:
    import torch

    gen = torch.Generator().manual_seed(seed)
    if dtype == "U8" and name.endswith("_scales"):  # block exponents around 2**-6
        return torch.randint(119, 124, shape, generator=gen, dtype=torch.uint8).numpy().tobytes()
    if dtype == "U8":
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).numpy().tobytes()
    if "norm" in name:
        t = torch.ones(shape) + 0.1 * torch.randn(shape, generator=gen)
    else:
        t = torch.randn(shape, generator=gen) * (0.02 if len(shape) > 1 else 0.1)
    return t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def write_safetensors(path: Path, tensors: list[tuple[str, list[int], str]]) -> int:
    """Write ``tensors`` (random contents) one at a time: the header first, then each
    tensor's bytes as they are made. Returns the file's size."""
    size = {"BF16": 2, "U8": 1}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, shape, dtype in tensors:
        n = math.prod(shape) * size[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i, (name, shape, dtype) in enumerate(tensors):
            f.write(_fill(name, shape, dtype, seed=i))
    return path.stat().st_size


def make(name: str, layers: int | None, out: Path, shard_bytes: int = 5 * 2**30) -> None:
    from tests.tiny_models import byte_bpe_tokenizer

    cfg = config_for(name, layers)
    out.mkdir(parents=True, exist_ok=True)
    tensors = tensor_shapes(cfg)
    shards: list[list[tuple[str, list[int], str]]] = [[]]
    used = 0
    for t in tensors:
        n = math.prod(t[1]) * (2 if t[2] == "BF16" else 1)
        if shards[-1] and used + n > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += n
    index: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / file, shard)
        index.update({t[0]: file for t in shard})
        print(f"  {file}: {len(shard)} tensors", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    byte_bpe_tokenizer(True).save_pretrained(out)
    print(f"{name}, {cfg['num_hidden_layers']} layers: {total / 1e9:.2f} GB in {out}")


# -- serve -----------------------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (children of any of its threads: the engine core is
    started from the server's loading thread)."""
    out = [pid]
    children: list[str] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += (task / "children").read_text().split()
    except FileNotFoundError:
        return out
    for child in children:
        out += _tree(int(child))
    return out


def _status(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


class RssMeter:
    """The summed RSS of a process tree, sampled every 50 ms (its peak), and each process's
    own high-water mark (VmHWM) at the end."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.hwm = pid, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = _tree(self.pid)
            self.peak = max(self.peak, sum(_status(p, "VmRSS") for p in pids))
            self.hwm = max(self.hwm, sum(_status(p, "VmHWM") for p in pids))
            time.sleep(0.05)

    def now(self) -> int:
        return sum(_status(p, "VmRSS") for p in _tree(self.pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _complete(url: str, max_tokens: int, seed: int, out: list[tuple[float, int]]) -> None:
    import httpx

    body = {"prompt": f"Request {seed}: once upon a time", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
    r.raise_for_status()
    out.append((time.monotonic() - start, r.json()["usage"]["completion_tokens"]))


def tpot(url: str, streams: int, max_tokens: int) -> tuple[float, float]:
    """(ms a token after the first, tokens/s over all streams) of ``streams`` requests at
    once. Random weights make tokens the tokenizer may not spell (empty stream chunks), so a
    token's time is read from whole requests: (time of N tokens - time of 1) / (N - 1)."""
    def run(n: int) -> tuple[float, float, int]:
        out: list[tuple[float, int]] = []
        threads = [threading.Thread(target=_complete, args=(url, n, i, out))
                   for i in range(streams)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(out) == streams and all(k == n for _, k in out), out
        return time.monotonic() - start, statistics.median(s for s, _ in out), n * streams

    _, first, _ = run(1)
    elapsed, each, tokens = run(max_tokens)
    return 1000 * (each - first) / (max_tokens - 1), tokens / elapsed


def _command(server: str, model: Path, port: int, extra: list[str]) -> list[str]:
    if server == "ringserve":
        return [sys.executable, "-m", "ringserve.server.cli", "serve", "--model", str(model),
                "--port", str(port), *extra]
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    from setup_llamacpp import build_dir

    binary = build_dir() / "bin" / "llama-server"
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: run benchmarks/peers/setup_llamacpp.py")
    return [str(binary), "-m", str(model), "--port", str(port), "-t",
            str(len(os.sched_getaffinity(0))), *extra]


def serve(folder: Path, extra: list[str], streams: list[int], max_tokens: int,
          port: int, server: str = "ringserve") -> dict[str, Any]:
    import httpx

    from benchmarks.peers.read_limit import read_bandwidth

    url = f"http://127.0.0.1:{port}"
    log = Path(f"/tmp/real-shapes-{port}.log")
    cmd = _command(server, folder, port, extra)
    start = time.monotonic()
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    meter = RssMeter(proc.pid)
    result: dict[str, Any] = {"server": server, "model": str(folder), "flags": " ".join(extra)}
    try:
        while True:
            if proc.poll() is not None:
                result["error"] = f"exited {proc.returncode}: {log.read_text()[-2000:]}"
                return result
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        result["start_s"] = round(time.monotonic() - start, 1)
        result["peak_rss_loading_gb"] = round(meter.peak / 1e9, 2)
        text = log.read_text()
        found = re.search(r"a decode step reads ([\d.]+) MiB", text)
        step_bytes = float(found.group(1)) * 2**20 if found else None
        tpot(url, 1, 4)  # warm
        for n in streams:
            ms, rate = tpot(url, n, max_tokens)
            result[f"tpot_ms_{n}"] = round(ms, 1)
            result[f"tok_s_{n}"] = round(rate, 2)
        result["serving_rss_gb"] = round(meter.now() / 1e9, 2)
        # the engine core alone (the tree's largest process), to hold against its plan
        result["core_rss_gb"] = round(max(_status(p, "VmRSS") for p in _tree(proc.pid)) / 1e9, 2)
        result["peak_rss_gb"] = round(max(meter.peak, meter.hwm) / 1e9, 2)
        if step_bytes is not None:
            gbs = read_bandwidth()
            result["decode_step_mib"] = round(step_bytes / 2**20, 1)
            result["read_limit_ms"] = round(1000 * step_bytes / gbs, 1)
            result["read_gb_s"] = round(gbs / 1e9, 1)
        plan = [line.split("memory plan: ", 1)[1] for line in text.splitlines()
                if "memory plan: " in line]
        result["plan"] = plan[-1] if plan else None
        total = re.search(r"= ([\d.]+) GiB", plan[-1]) if plan else None
        if total:
            result["plan_gb"] = round(float(total.group(1)) * 2**30 / 1e9, 2)
    finally:
        meter.stop()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="write a random checkpoint at a model's real shapes")
    m.add_argument("model", choices=sorted(MODELS))
    m.add_argument("--layers", type=int, default=None, help="default: the model's own")
    m.add_argument("--out", type=Path, required=True)
    g = sub.add_parser("gguf", help="llama.cpp's converter on a folder")
    g.add_argument("folder", type=Path)
    g.add_argument("--outtype", default="q8_0")
    g.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("serve", help="serve a folder or .gguf; print start, RSS and TPOT")
    s.add_argument("folder", type=Path)
    s.add_argument("--server", choices=("ringserve", "llamacpp"), default="ringserve")
    s.add_argument("--streams", default="1,4,16")
    s.add_argument("--max-tokens", type=int, default=48)
    s.add_argument("--port", type=int, default=8765)
    p = sub.add_parser("plan", help="what every layer count needs, from the config alone")
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    args, extra = parser.parse_known_args()
    if args.command == "make":
        make(args.model, args.layers, args.out)
    elif args.command == "gguf":
        from tests import llamacpp_convert

        print(llamacpp_convert.convert(args.folder, args.out, args.outtype))
    elif args.command == "serve":
        streams = [int(x) for x in args.streams.split(",")]
        extra = [x for x in extra if x != "--"]
        print(json.dumps(serve(args.folder, extra, streams, args.max_tokens, args.port,
                               args.server), indent=1))
    else:
        plan_table(args.model, args.seqs, args.tokens)


def plan_table(name: str, seqs: int, tokens: int) -> None:
    """What every layer count needs, from the config alone: the weights as a CPU serves them
    (`memory_plan.estimate_weights`: bf16 kept, MXFP4 as stored) and bf16 KV for ``seqs``
    sequences of ``tokens`` (the ring bounds the sliding layers)."""
    import torch
    import transformers

    from ringserve.engine.kv_cache import kv_cache_spec
    from ringserve.engine.memory_plan import GiB, estimate_weights
    from ringserve.engine.models import model_config_from_hf

    full = MODELS[name]["num_hidden_layers"]
    for layers in sorted({1, 4, full // 2, full}):
        cfg = config_for(name, layers)
        stored = {n: (kind, tuple(shape)) for n, shape, kind in tensor_shapes(cfg)}
        weights = estimate_weights(stored, act_bytes=4, keeps_bf16=True, quantization="none")
        hf = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                                 if k not in ("architectures",
                                                              "quantization_config")})
        spec = kv_cache_spec(model_config_from_hf(hf), 16, torch.bfloat16,
                             prefix_caching=True)
        kv = seqs * spec.pool_blocks_needed(tokens) * spec.block_bytes
        print(f"{name}, {layers:2d} layers: weights {weights / GiB:6.2f} GiB + bf16 KV for "
              f"{seqs} x {tokens} tokens {kv / GiB:5.2f} GiB = {(weights + kv) / GiB:6.2f} GiB "
              "(+ the runtime, ~0.3-0.5 GiB)")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
