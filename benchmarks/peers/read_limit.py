"""The memory-read ceiling of a decode step: every step reads all the weights and the whole
batch's KV, so a batch of `c` sequences cannot make more than
`c * bandwidth / (weight bytes + c * context * KV bytes per token)` tokens a second."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ringserve.kernels import hugepages

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def read_bandwidths(megabytes: int = 256, threads: int = 2,
                    repeats: int = 20) -> dict[str, float]:
    """Bytes per second that `threads` threads read, the best of `repeats` sums of a buffer,
    by the page size the buffer sits on: "4 KiB" (an ordinary allocation) and, where Linux
    offers transparent huge pages, "2 MiB". On a virtual machine the two differ by up to
    2x (every 4 KiB TLB miss walks two page tables: docs/cpu.md, "Huge pages for the copies
    a step streams"); the faster is what the memory can deliver."""
    torch.set_num_threads(threads)
    count = megabytes * 2**20 // 4
    buffers = {"4 KiB": torch.ones(count, dtype=torch.float32)}
    if hugepages.offered():
        buffers["2 MiB"] = hugepages.huge_zeros((count,), torch.float32).fill_(1.0)
    out = {}
    for name, buffer in buffers.items():
        buffer.sum()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        out[name] = buffer.numel() * 4 / best
    return out


def read_bandwidth(megabytes: int = 256, threads: int = 2, repeats: int = 20) -> float:
    """The faster of `read_bandwidths`: the read a step that costs only its reads gets."""
    return max(read_bandwidths(megabytes, threads, repeats).values())


def weight_bytes(weights: str, parameters: int, gguf: Path | None) -> int:
    """A GGUF file's size, or parameters x bytes per parameter in `weights`' dtype."""
    if weights == "gguf":
        assert gguf is not None
        return gguf.stat().st_size
    return parameters * BYTES[weights]


def kv_element_bytes(weights: str) -> int:
    """ringserve and vLLM keep KV in the model's dtype; llama.cpp in float16 (its default)."""
    return 2 if weights == "gguf" else BYTES[weights]


def kv_bytes_per_token(hf_folder: Path, element_bytes: int) -> int:
    """K and V of one token in every layer (the context here stays inside every window)."""
    config = json.loads((hf_folder / "config.json").read_text())
    config = config.get("text_config", config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return int(2 * config["num_hidden_layers"] * kv_heads * head_dim * element_bytes)


def ceiling(concurrency: int, weights: int, kv_per_token: int, context: int,
            bandwidth: float) -> float:
    """Output tokens a second when a step costs only its reads (`context`: mean tokens held)."""
    step_bytes = weights + concurrency * context * kv_per_token
    return concurrency * bandwidth / step_bytes
