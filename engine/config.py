"""Engine settings: one frozen object, checked when made."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ringserve.engine.errors import InvalidRequestError


def json_object(value: dict[str, Any] | str, param: str,
                known: Collection[str]) -> dict[str, Any]:
    """A JSON-valued setting (vLLM's ``--speculative-config``, ``--kv-events-config``) as a
    dict: its JSON text or a dict, with no key outside ``known``.

    Raises:
        InvalidRequestError: not JSON, not an object, or an unknown key, naming ``param``.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise InvalidRequestError(f"{param} is not JSON: {err}", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be a JSON object", param=param)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise InvalidRequestError(f"{param}: unknown keys {unknown}; known: {sorted(known)}",
                                  param=param)
    return dict(value)

DEFAULT_CPU_KV_MEMORY = "2GiB"  # where no budget can be read (no /proc/meminfo)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.90


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything the engine needs to start.

    Args:
        model: a preset name, an HF folder or a .gguf file.
        dtype: "auto", "float32", "bfloat16" or "float16".
        quantization: "auto", "none", "int8", "int4" or "gguf" (weight-only; see
            `engine.loading.quantize`).
        int16_activations: "auto", "on" or "off": whether quantized linears round float32
            activations to int16 blocks for integer dot products (auto: on CPUs without
            bf16 arithmetic; see `engine.loading.quantize.pick_int16_activations`).
        kv_cache_dtype: "auto" (the model's dtype; bf16 where int16 activations are on) or
            "bfloat16": a float32 model on the CPU keeping its KV cache in bf16 (half the
            bytes a block, twice the sequences).
        device: "cpu", "cuda", "cuda:N"; None = CUDA if available, else CPU.
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV pool ("2GiB"); None = the device default (CPU:
            what ``memory_budget`` leaves after the weights, their copies and the
            workspace, at most what ``max_num_seqs`` sequences of ``max_model_len`` tokens
            need; CUDA: a fraction of free memory after weights and a profiled step).
        memory_budget: what the engine process may hold in all (`engine.memory_plan`):
            None or "auto" = 90% of what the machine (or its cgroup) has available at
            start, a share in (0, 1], or a size ("20GiB"); a model whose weights do not
            fit is refused before it loads.
        max_num_seqs: sequences running at once.
        max_num_batched_tokens: tokens fed to the model per step.
        max_prefill_slowdown: while sequences decode, prefill chunks take only the tokens
            that keep the step's predicted time (`engine.spec_decode.StepCost`, learned
            from this machine's steps) within this factor of a decode-only step: arriving
            prompts then slow running streams' TPOT by at most that much (at least one
            block of prefill a step). None = no cap (chunks fill max_num_batched_tokens).
        packed_head_rows: steps of at least this many rows multiply a quantized output
            head by a copy widened to bf16 once (its bytes are logged; AVX-512 or AMX
            CPUs); None = the quantized head for every step, unless packed_rows is
            "auto" and packs: then AUTO_INT8_ROWS (2) where the one-byte copies are,
            else AUTO_PACKED_HEAD_ROWS (5).
        packed_rows: the same for every quantized linear: steps (and prefill chunks) of
            at least this many rows multiply by copies widened to bf16 once of the
            quantized weights, which stay for smaller steps (bytes logged: about twice the
            parameters, three times with the one-byte copies that steps of up to
            INT8_TILE_ROWS (16) rows read); None = off; "auto" = 2 where the copies are
            the kernels' own bf16 and one-byte tiles (AVX512-BF16 or AMX) and take at most
            a quarter of the memory available
            (`engine.models.linear_copies.auto_packed_rows`), else off.
        rounded_copy_rows: steps (prefill chunks, mostly) of at least this many rows
            multiply every quantized linear but the output head by oneDNN's bf16 GEMM over a
            copy of its weight rounded to bf16 (about 2 bytes a parameter more, logged;
            AVX-512 or AMX CPUs): faster than the exact AMX tiles from ~150 rows, but not
            exact (8 significant bits a weight; `benchmarks/accuracy.py` measures it).
            None = off (the default).
        greedy_head: "auto" or "off": greedy rows (temperature 0, no logprobs, nothing
            that changes their logits) of steps of at least `greedy_head.min_rows()` rows
            (2 with AVX512-VNNI, 4 with the AVX2 pass) take their token from an int8 pass
            that bounds every logit and the exact logits of the few rows that can be the
            maximum (`engine.models.greedy_head`; the same token, bit for bit; a one-byte
            copy of the head, logged); "auto" = on where it can serve (an int8 head, bf16
            or float32 activations, AVX512-VNNI or AVX2).
        kv_events_config: vLLM's ``--kv-events-config`` (JSON text or a dict), e.g.
            ``{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}``: the prefix
            cache's BlockStored / BlockRemoved events on a ZMQ PUB socket
            (`engine.kv_events`); None = off.
        scheduling_policy: "fcfs" (admit in arrival order) or "lpm" (with prefix
            caching: first the waiting prompt that finds the most tokens cached, never
            passing one over more than 8 times; SGLang's longest prefix match).
        max_model_len: prompt + output tokens at most; None = the model's limit.
        seed: the global seed for unseeded sampling.
        enable_prefix_caching: reuse the K/V of prompt prefixes computed before (vLLM's
            automatic prefix caching; on by default, as in vLLM v1).
        debug_kv: check every cached position a step reads against a shadow of slot
            owners (O(window) per sequence and step; tests turn it on). Without it, the
            oldest and newest position each step reads are checked, at O(1).
        cache_dir: where converted models are kept.
        speculative_config: vLLM's, e.g. ``{"method": "ngram", "num_speculative_tokens":
            3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` (a dict or its JSON text;
            see `engine.spec_decode`); None = off.
    """

    model: str
    dtype: str = "auto"
    quantization: str = "auto"
    int16_activations: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str | None = None
    block_size: int = 16
    kv_cache_memory: str | int | None = None
    memory_budget: str | int | float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_slowdown: float | None = None
    packed_head_rows: int | None = None
    packed_rows: int | str | None = None
    rounded_copy_rows: int | None = None
    greedy_head: str = "auto"
    scheduling_policy: str = "fcfs"
    kv_events_config: str | dict[str, Any] | None = None
    max_model_len: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    debug_kv: bool = False
    cache_dir: str | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    speculative_config: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        checks = [
            ("block_size", 1 <= self.block_size <= 128, "must be in [1, 128]"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= self.max_num_seqs,
             f"must be >= max_num_seqs ({self.max_num_seqs}) so every decode fits a step"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2,
             "must be >= 2"),
            ("max_prefill_slowdown",
             self.max_prefill_slowdown is None or self.max_prefill_slowdown > 1.0,
             "must be > 1 (or None: no cap)"),
            ("scheduling_policy", self.scheduling_policy in ("fcfs", "lpm"),
             "must be fcfs or lpm"),
            ("packed_head_rows", self.packed_head_rows is None or self.packed_head_rows >= 1,
             "must be >= 1 (or None: off)"),
            ("packed_rows", self.packed_rows is None or self.packed_rows == "auto"
             or (isinstance(self.packed_rows, int) and self.packed_rows >= 1),
             "must be >= 1, \"auto\" (or None: off)"),
            ("rounded_copy_rows",
             self.rounded_copy_rows is None or self.rounded_copy_rows >= 1,
             "must be >= 1 (or None: off)"),
            ("greedy_head", self.greedy_head in ("auto", "off"), "must be auto or off"),
            ("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0,
             "must be in (0, 1]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {rule}, got {getattr(self, name)!r}",
                                          param=name)
