"""Start-up decisions: the device, the dtype, and the process's memory plan (whether the
model fits its budget, and how much memory the KV pool gets)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ringserve.block_manager import KVCacheSpec, parse_size, plan_num_blocks
from ringserve.engine.config import DEFAULT_CPU_KV_MEMORY, EngineConfig
from ringserve.engine.errors import InvalidRequestError
from ringserve.engine.loading import parse_dtype
from ringserve.engine.loading.checkpoint import stored_tensors
from ringserve.engine.loading.find import gguf_weights_file
from ringserve.engine.loading.gguf_blocks import SUPPORTED_TYPES, repacked_bytes
from ringserve.engine.loading.gguf_file import GgufFile, open_gguf
from ringserve.engine.loading.quantize import WeightBytes, pick_int16_activations
from ringserve.engine.memory_plan import (
    GiB,
    MemoryPlan,
    estimate_weights,
    pick_budget,
    resident_bytes,
    step_activations,
)
from ringserve.engine.models.config import ModelConfig
from ringserve.kernels import cpu_build, cpu_isa

logger = logging.getLogger("ringserve.engine")


def pick_device(name: str | None) -> torch.device:
    """``name``, or CUDA when one is there, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device 'cuda' asked for, but no CUDA device is visible",
                                  param="device")
    return device


def cpu_bf16_units() -> list[str]:
    """The bf16 matmul units of this CPU that oneDNN uses: "AMX-BF16", "AVX512-BF16"; none
    where RINGSERVE_CPU_ISA caps the class below them (`kernels.cpu_isa`)."""
    if not cpu_isa.bf16_arithmetic():
        return []
    probes = (("AMX-BF16", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    # NOTE: torch.cpu's probes are private; a torch without them reports no unit (float32).
    units = [unit for unit, probe in probes if getattr(torch.cpu, probe, lambda: False)()]
    return [u for u in units if u != "AMX-BF16" or cpu_isa.info().at_least("amx")]


def pick_dtype(name: str, device: torch.device, hf_config: object) -> tuple[torch.dtype, str]:
    """The model's dtype and, for the start-up log, why.

    "auto" on the CPU is bfloat16 where the CPU multiplies bf16 in hardware (AMX or
    AVX512-BF16, as vLLM's CPU build chooses) and float32 elsewhere, where bf16 arithmetic
    is emulated: there activations stay float32 while compact weights (a GGUF model's
    blocks, `engine.loading.quantize`) are widened in registers. "bfloat16" is served on
    every CPU (bf16 storage; float32 arithmetic where the CPU has no bf16 units). On CUDA
    "auto" is the checkpoint's own dtype.

    Raises:
        InvalidRequestError: an unknown dtype name, naming the parameter.
    """
    try:
        if name != "auto":
            return parse_dtype(name, hf_config), "asked for"  # type: ignore[arg-type]
        if device.type != "cpu":
            return parse_dtype("auto", hf_config), "auto: the checkpoint's dtype"  # type: ignore[arg-type]
    except ValueError as err:
        raise InvalidRequestError(str(err), param="dtype") from None
    units = cpu_bf16_units()
    if units:
        return torch.bfloat16, f"auto: this CPU multiplies bf16 in hardware ({', '.join(units)})"
    return torch.float32, "auto: this CPU has neither AMX-BF16 nor AVX512-BF16"


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "float16")


def pick_kv_dtype(name: str, dtype: torch.dtype, device: torch.device, *,
                  int16_activations: bool = False) -> tuple[torch.dtype, str]:
    """The KV cache's dtype and, for the start-up log, why: "auto" is the model's dtype,
    or bfloat16 under a float32 model whose linears round their activations to int16
    (`engine.loading.quantize.pick_int16_activations`: no longer bit-faithful to float32,
    and a bf16 cache holds twice the sequences; on gemma-3-270m 99.55% top-1 against
    float32, the bf16-activation path 97.36%: benchmarks/results/int16_activations.md);
    "bfloat16" under a float32 model on the CPU halves every block (the decode kernel
    widens it in registers); any other dtype than the model's is refused naming
    ``kv_cache_dtype``.

    Raises:
        InvalidRequestError: an unknown name, or a combination no kernel serves.
    """
    name = (name or "auto").lower().replace("bf16", "bfloat16").replace("fp32", "float32")
    if name not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}"
                                  f"; got {name!r}", param="kv_cache_dtype")  # fmt: skip
    if name == "auto":
        if int16_activations and dtype == torch.float32 and device.type == "cpu":
            return torch.bfloat16, "auto: int16 activations round already; twice the blocks"
        return dtype, "auto: the model's dtype"
    wanted = getattr(torch, name)
    if wanted == dtype:
        return dtype, "asked for"
    if wanted == torch.bfloat16 and dtype == torch.float32 and device.type == "cpu":
        return wanted, "asked for: float32 activations over a bf16 cache"
    raise InvalidRequestError(
        f"kv_cache_dtype {name} with a {str(dtype).removeprefix('torch.')} model: only the "
        "model's own dtype, or bfloat16 under a float32 model on the CPU",
        param="kv_cache_dtype")


def pick_numerics(config: EngineConfig, quantization: str, dtype: torch.dtype,
                  device: torch.device, *, mxfp4: bool = False) -> tuple[bool, torch.dtype]:
    """Whether the quantized linears (``mxfp4``: and the MXFP4 experts of a model with no
    quantization method) take int16 activations, and the KV cache's dtype (which follows
    them), each logged with its reason.

    Raises:
        InvalidRequestError: ``int16_activations`` or ``kv_cache_dtype`` cannot be served.
    """
    mxfp4 = mxfp4 and device.type == "cpu"  # (elsewhere the experts are widened at load)
    int16, why = pick_int16_activations(config.int16_activations, quantization=quantization,
                                        dtype=dtype, mxfp4=mxfp4)  # fmt: skip
    if quantization != "none" or mxfp4:
        logger.info("int16 activations %s (%s)", "on" if int16 else "off", why)
    kv_dtype, why = pick_kv_dtype(config.kv_cache_dtype, dtype, device, int16_activations=int16)
    if kv_dtype != dtype:
        logger.info("KV cache dtype %s (%s)", str(kv_dtype).removeprefix("torch."), why)
    return int16, kv_dtype


def kv_memory_bytes(config: EngineConfig, device: torch.device,
                    profile_peak: int | None = None) -> int:
    """Bytes for the KV pool.

    Explicit ``kv_cache_memory`` wins (on the CPU the engine's memory plan sizes it
    otherwise: `LLMEngine._plan_memory`; this default is for a caller without one). On CUDA it is
    ``gpu_memory_utilization`` of the device's total memory, less what the weights and one
    profiled max-size step (``profile_peak``, bytes) already took.
    """
    if config.kv_cache_memory is not None:
        try:
            return parse_size(config.kv_cache_memory)
        except ValueError as err:
            raise InvalidRequestError(str(err), param="kv_cache_memory") from None
    if device.type != "cuda":
        return parse_size(DEFAULT_CPU_KV_MEMORY)
    total = torch.cuda.get_device_properties(device).total_memory
    used = profile_peak if profile_peak is not None else torch.cuda.max_memory_allocated(device)
    free = int(total * config.gpu_memory_utilization) - used
    if free <= 0:
        raise InvalidRequestError(
            f"no GPU memory left for the KV cache: weights and activations take {used} bytes "
            f"of {total}", param="gpu_memory_utilization")
    return free


def describe(spec: KVCacheSpec, num_blocks: int, memory: int) -> str:
    """The KV pool in one line for the start-up log."""
    used = num_blocks * spec.block_bytes
    return f"KV cache: {used / 2**20:.1f} MiB of {memory / 2**20:.1f} MiB budget"


def describe_cpu_kernels(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """The CPU class and the path each kind of layer took, for the start-up log."""
    from ringserve.engine.models.packed_linear import CompactLinear, Mxfp4Linear, PackedLinear
    from ringserve.engine.models.quant_linear import INT8_TILE_ROWS, QuantLinear
    from ringserve.kernels import cpu_build

    info = cpu_isa.info()
    built = cpu_build.available()
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            name = "oneDNN packed bf16" + (" (+ dpbf16 GEMV)" if module.small else "")
        elif isinstance(module, CompactLinear):
            name = "compact bf16, float32 FMA"
        elif isinstance(module, Mxfp4Linear):
            name = "mxfp4 " + ("int16-activation dot" if module.int16_acts else "float32 FMA")
        elif isinstance(module, QuantLinear):
            if not module.kernel:
                name = f"int{module.bits} widened every call (no kernel)"
            elif module.int16_acts:
                name = f"int{module.bits} int16-activation dot"
            elif dtype == torch.bfloat16 and info.variant == "avx512_bf16":
                name = f"int{module.bits} dpbf16" + (", AMX tiles for many rows"
                                                     if cpu_build.amx() else "")
            else:
                name = f"int{module.bits} float32 FMA"
            if module.packed_rows is not None and module.tiles8 is not None:
                size = "one-byte" if module.bits == 8 else "half-byte"
                name += (f" (+ {size} copy from 1 to {INT8_TILE_ROWS} "
                         "rows, bf16 copy beyond)")
            elif module.packed_rows is not None:
                name += f" (+ bf16 copy from {module.packed_rows} rows)"
            if module.rounded_rows is not None:
                name += f" (+ oneDNN over a bf16-rounded copy from {module.rounded_rows} rows)"
        elif type(module) is torch.nn.Linear:
            name = f"torch {str(dtype).removeprefix('torch.')} F.linear"
        else:
            continue
        counts[name] = counts.get(name, 0) + 1
    linears = ", ".join(f"{n} {name}" for name, n in counts.items()) or "none"
    kernels = f"{info.variant} kernels" if built else "no compiled kernels (torch paths)"
    return f"{info.describe()}; {kernels}; linears: {linears}"


def has_mxfp4(hf_config: Any) -> bool:
    """Whether the model's config says its experts are MXFP4 blocks (gpt-oss as published,
    and a GGUF whose experts are MXFP4: `engine.loading.gguf_model`)."""
    quant = getattr(hf_config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else \
        getattr(quant, "quant_method", None)
    return str(method).lower() == "mxfp4"


def check_fits(config: EngineConfig, path: Path, *, dtype: torch.dtype, device: torch.device,
               quantization: str) -> tuple[int | None, int]:
    """(the process's memory budget, or None where nothing can say; the runtime's resident
    bytes now), refusing, before anything is loaded, a model whose weights (estimated from
    the checkpoint's headers, `memory_plan.estimate_weights`) and the runtime already exceed
    the budget (docs/design.md §12).

    Raises:
        InvalidRequestError: a bad ``memory_budget``, or a model that cannot fit, naming it.
    """
    try:
        budget, why = pick_budget(config.memory_budget)
    except ValueError as err:
        raise InvalidRequestError(str(err), param="memory_budget") from None
    runtime = resident_bytes()
    native = device.type == "cpu" and cpu_build.available()
    act_bytes = torch.empty((), dtype=dtype).element_size()
    source = gguf_weights_file(path)
    stored, held = (stored_tensors(path), 0) if source is None else _gguf_stored(
        open_gguf(source), quantization=quantization, native=native, act_bytes=act_bytes)
    estimate = estimate_weights(
        stored, act_bytes=act_bytes, keeps_bf16=native and dtype == torch.float32,
        quantization=quantization, gguf_blocks=held, mxfp4_native=native)
    logger.info("memory budget %s (%s); the weights will take ~%.2f GiB, the runtime %.2f GiB "
                "now", "unknown" if budget is None else f"{budget / GiB:.2f} GiB", why,
                estimate / GiB, runtime / GiB)
    if budget is not None and estimate + runtime > budget:
        raise InvalidRequestError(
            f"the model does not fit: its weights take ~{estimate / GiB:.2f} GiB and the "
            f"runtime {runtime / GiB:.2f} GiB, over the memory budget of {budget / GiB:.2f} "
            f"GiB ({why}); raise memory_budget, or serve it quantized (quantization int8 / "
            "int4, or a GGUF file)", param="memory_budget")
    return budget, runtime


def _gguf_stored(file: GgufFile, *, quantization: str, native: bool, act_bytes: int,
                 ) -> tuple[dict[str, tuple[str, tuple[int, ...]]], int]:
    """A GGUF's tensors for `estimate_weights`: (the float ones and those that will be
    dequantized, as float32 entries; the bytes of those held in their blocks: MXFP4 as
    stored, or widened where not ``native``; block types with a layout here, repacked,
    under quantization gguf)."""
    stored: dict[str, tuple[str, tuple[int, ...]]] = {}
    held = 0
    for tensor in file.tensors:
        kind = tensor.tensor_type
        if kind.name in ("F32", "F16", "BF16"):
            stored[tensor.name] = (kind.name, tensor.hf_shape)
        elif kind.name == "MXFP4":
            held += tensor.n_bytes if native else 2 * act_bytes * tensor.n_elements
        elif kind in SUPPORTED_TYPES and quantization == "gguf":
            held += repacked_bytes(kind, tensor.n_elements)
        else:
            stored[tensor.name] = ("F32", tensor.hf_shape)  # dequantized
    return stored, held


def plan_memory(config: EngineConfig, spec: KVCacheSpec, budget: int | None, *,
                weights: WeightBytes, runtime: int, model: ModelConfig, max_model_len: int,
                dtype: torch.dtype, device: torch.device) -> MemoryPlan:
    """The process's plan, logged: the KV pool is ``kv_cache_memory`` where set (and on
    CUDA, its share of the device); else what the budget leaves after the weights, their
    copies and the workspace, but no more than ``max_num_seqs`` sequences of
    ``max_model_len`` tokens can ever hold (every request's KV is known when it arrives, so
    more could only ever hold cached prefixes).

    Raises:
        InvalidRequestError: the budget leaves no room for one sequence (memory_budget).
    """
    workspace = runtime + step_activations(
        tokens=config.max_num_batched_tokens, rows=config.max_num_seqs,
        hidden=model.hidden_size,
        intermediate=max(model.intermediate_size, model.moe_intermediate_size),
        qkv=(model.num_heads + 2 * model.num_kv_heads) * model.head_dim,
        vocab=model.vocab_size, act_bytes=torch.empty((), dtype=dtype).element_size())
    own = weights.resident - weights.copies
    one = spec.pool_blocks_needed(max_model_len) * spec.block_bytes
    if config.kv_cache_memory is not None or device.type != "cpu":
        kv = kv_memory_bytes(config, device)
    else:
        every = config.max_num_seqs * one
        left = None if budget is None else budget - own - weights.copies - workspace
        kv = min(every, parse_size(DEFAULT_CPU_KV_MEMORY) if left is None else max(left, 0))
        if kv < one:
            assert budget is not None  # without one the pool is a fixed size
            raise InvalidRequestError(
                f"the memory budget ({budget / GiB:.2f} GiB) leaves {kv / GiB:.2f} GiB after "
                f"the weights ({own / GiB:.2f} GiB), their copies "
                f"({weights.copies / GiB:.2f} GiB) and the workspace "
                f"({workspace / GiB:.2f} GiB): not one sequence of max_model_len "
                f"{max_model_len} tokens ({one / 2**20:.1f} MiB of KV); raise memory_budget "
                "or lower max_model_len", param="memory_budget")
    plan = MemoryPlan(budget, weights=own, copies=weights.copies,
                      kv=plan_num_blocks(spec, kv) * spec.block_bytes, workspace=workspace)
    logger.info("%s", plan.describe())
    return plan
