"""The CPU serving path: decode rows through a compiled kernel that reads the ring in place.

The torch reference serves a decode row by copying its whole window out of the cache
(gather), widening the copy to float32 (a second copy) and running two bmm calls: about six
times the bytes the attention needs, every layer. `csrc/paged_decode.cpp` reads each K and
V row of the window once, through the block table, and writes the output row directly.
Prefill chunks are compute-bound and stay on the reference's bmm path.

The kernel is compiled with the machine's own compiler on first use (about a minute, once:
the build lands in torch's extension cache, keyed by the source, the flags and this CPU's
features). Where it cannot be built (no compiler, no ninja) or RINGSERVE_CPU_KERNELS=0 is
set, `available()` is False and the torch reference serves everything, as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from kernels.reference import Batch, prefill_row
from kernels.torch_plan import step_plan

logger = logging.getLogger("ringserve.kernels")

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_DTYPES = (torch.float32, torch.bfloat16)
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags: a build made for another CPU is not reused."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")  # fmt: skip
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def available() -> bool:
    """Whether the compiled decode kernel is loaded (builds it on the first call)."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _build()
    return _state["ok"]


def _build() -> bool:
    if os.environ.get("RINGSERVE_CPU_KERNELS", "1") == "0":
        logger.info("CPU decode kernel off (RINGSERVE_CPU_KERNELS=0): torch path")
        return False
    try:
        from torch.utils.cpp_extension import load

        load(name=f"ringserve_paged_decode_{_cpu_tag()}", sources=[str(_SOURCE)],
             extra_cflags=["-O3", "-march=native", "-fopenmp"], is_python_module=False,
             verbose=False)  # fmt: skip
    except Exception as err:  # no compiler, no ninja, a build error: serve with torch
        logger.warning("CPU decode kernel unavailable, using the torch path: %s",
                       str(err).strip().splitlines()[-1] if str(err).strip() else err)
        return False
    return True


def supports(query: torch.Tensor) -> bool:
    """Whether `paged_attention_cpu` takes this call (CPU tensor of a dtype it compiles)."""
    return query.device.type == "cpu" and query.dtype in _DTYPES and available()


def paged_attention_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    ring_blocks: int | None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernels.paged_attention` on the CPU: same arguments, same result (see there).

    Prefill rows go through the torch reference; decode rows (one new token after a
    cached context) through the compiled kernel, which reads the ring in place.
    """
    result = out if out is not None and out.is_contiguous() else torch.empty_like(query)
    args = Batch(
        query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
        block_size=key_cache.shape[1], window=sliding_window, ring=ring_blocks, scale=scale,
        softcap=softcap,
    )
    plan = step_plan(block_tables, query_start_loc, context_lens, block_size=args.block_size,
                     window=sliding_window, ring=ring_blocks)  # fmt: skip
    for row in plan.prefill:
        prefill_row(args, row, result)
    seqs, tokens, ctxs = plan.decode_index
    if seqs.numel():
        torch.ops.ringserve.paged_decode(
            query.contiguous(), key.contiguous(), value.contiguous(), key_cache.contiguous(),
            value_cache.contiguous(), block_tables.to(torch.int32).contiguous(), seqs, tokens,
            ctxs, result, scale, sliding_window or 0, ring_blocks or 0, softcap or 0.0,
        )  # fmt: skip
    if out is not None and out is not result:
        out.copy_(result)
        return out
    return result
