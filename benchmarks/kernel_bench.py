"""Benchmark of `kernels.paged_attention` (decode), runnable anywhere.

On CUDA: achieved bandwidth of decode attention (bytes that must move: every sequence's
window of K and V, its fresh K/V, Q and O) against a device-to-device copy measured in the
same run, for Mistral-7B-like shapes (32 q heads, 8 kv heads, head_dim 128, window 4096,
block 16, bf16), with permuted physical blocks (paged) and with an identity block table
(each ring contiguous). Times come from CUDA events around CUDA-graph replays after a
warm-up; the median of many is reported.

On CPU: decode tokens/s of the torch path (one attention call; a model runs one per layer)
and its time relative to the peer, a plain contiguous SDPA over the same window.

    python benchmarks/kernel_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# NOTE: as the server runs (engine/__init__.py), set before torch loads: torch's OpenMP
# threads sleep between regions and our kernels run on their own pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringserve import kernels


@dataclass(frozen=True)
class Shape:
    """Attention shape of one model family."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int
    block_size: int = 16


MISTRAL = Shape("mistral-7b", 32, 8, 128, 4096)
CPU_SHAPES = [Shape("smollm2-135m-like", 9, 3, 64, 512), Shape("gemma3-270m-like", 4, 1, 256, 512)]


def decode_batch(
    shape: Shape, batch: int, ctx: int, dtype: torch.dtype, device: str, paged: bool
) -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
    """Inputs of one decode step: every sequence has `ctx` cached positions and a full ring."""
    ring = -(-shape.window // shape.block_size)
    num_blocks = batch * ring
    gen = torch.Generator(device=device).manual_seed(0)
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    ids = torch.arange(num_blocks, device=device)
    if paged:
        ids = ids[torch.randperm(num_blocks, generator=gen, device=device)]
    tables = ids.view(batch, ring).to(torch.int32)
    q = torch.randn(batch, shape.num_heads, shape.head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
    qsl = torch.arange(batch + 1, device=device, dtype=torch.int32)
    ctxs = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    kwargs: dict[str, object] = {"scale": shape.head_dim**-0.5, "sliding_window": shape.window,
                                 "ring_blocks": ring}  # fmt: skip
    return (q, k, torch.randn_like(k), key_cache, value_cache, tables, qsl, ctxs), kwargs


def bytes_moved(shape: Shape, batch: int, ctx: int, dtype: torch.dtype) -> int:
    """Bytes decode attention must move: cached window K+V, fresh K+V, Q and O."""
    cached = min(ctx, shape.window - 1)
    kv_row = shape.num_kv_heads * shape.head_dim
    elems = 2 * (cached + 1) * kv_row + 2 * shape.num_heads * shape.head_dim
    return batch * elems * torch.empty((), dtype=dtype).element_size()


def cuda_seconds(fn: Callable[[], object], reps: int, calls: int = 10) -> float:
    """Median seconds per call: CUDA-graph replays of `calls` calls, timed by CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: compile the kernels outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth(reps: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_seconds(lambda: dst.copy_(src), reps, calls=5)
    return 2 * n / seconds


def gpu_report(quick: bool) -> None:
    """Bandwidth table of decode attention on CUDA, paged vs contiguous, against copy."""
    reps = 20 if quick else 100
    copy_bw = copy_bandwidth(reps)
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy_bw / 1e12:.2f} TB/s "
          "(read + write)")  # fmt: skip
    shape, dtype = MISTRAL, torch.bfloat16
    ctx = shape.window + 100  # the ring has wrapped: a full window per sequence
    print(f"{shape.name}: {shape.num_heads} q / {shape.num_kv_heads} kv heads, head_dim "
          f"{shape.head_dim}, window {shape.window}, block {shape.block_size}, bf16, ctx {ctx}")
    print(f"{'batch':>5} {'MB':>8} {'paged us':>9} {'TB/s':>6} {'%copy':>6} "
          f"{'contig us':>9} {'TB/s':>6} {'%copy':>6} {'paging':>7}")
    for batch in [1, 8, 64] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]:
        moved = bytes_moved(shape, batch, ctx, dtype)
        row = []
        for paged in (True, False):
            args, kwargs = decode_batch(shape, batch, ctx, dtype, "cuda", paged)
            out = torch.empty_like(args[0])
            seconds = cuda_seconds(lambda a=args, kw=kwargs, o=out: kernels.paged_attention(
                *a, **kw, out=o), reps)
            row.append((seconds, moved / seconds))
            del args
        (tp, bwp), (tc, bwc) = row
        print(f"{batch:>5} {moved / 1e6:>8.1f} {tp * 1e6:>9.1f} {bwp / 1e12:>6.2f} "
              f"{100 * bwp / copy_bw:>5.1f}% {tc * 1e6:>9.1f} {bwc / 1e12:>6.2f} "
              f"{100 * bwc / copy_bw:>5.1f}% {100 * (tp / tc - 1):>+6.1f}%")


def cpu_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall seconds per call after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_report(quick: bool) -> None:
    """Decode tokens/s of the torch path against contiguous SDPA over the same window."""
    reps = 10 if quick else 40
    ctx = 1000
    print(f"CPU torch path, fp32, {torch.get_num_threads()} threads, ctx {ctx} (ring wrapped); "
          "time of one attention call (one layer)")
    print(f"{'shape':>18} {'batch':>5} {'paged ms':>9} {'tok/s':>9} {'peer ms':>8} {'ratio':>6}")
    for shape in CPU_SHAPES:
        for batch in [1, 8] if quick else [1, 8, 32, 64]:
            args, kwargs = decode_batch(shape, batch, ctx, torch.float32, "cpu", paged=True)
            paged = cpu_seconds(lambda a=args, kw=kwargs: kernels.paged_attention(
                *a, **kw, backend="torch"), reps)
            kv = (batch, shape.num_kv_heads, min(ctx + 1, shape.window), shape.head_dim)
            k, v = torch.randn(kv), torch.randn(kv)
            q = args[0].view(batch, shape.num_heads, 1, shape.head_dim)
            scale = shape.head_dim**-0.5
            peer = cpu_seconds(lambda q=q, k=k, v=v, s=scale: F.scaled_dot_product_attention(
                q, k, v, scale=s, enable_gqa=True), reps)
            print(f"{shape.name:>18} {batch:>5} {paged * 1e3:>9.3f} {batch / paged:>9.0f} "
                  f"{peer * 1e3:>8.3f} {paged / peer:>6.2f}")


def main() -> None:
    """Run the CUDA table when a GPU is present, else the CPU one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--cpu", action="store_true", help="the CPU table even with a GPU")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.cuda.is_available() and not args.cpu:
        gpu_report(args.quick)
    else:
        cpu_report(args.quick)


if __name__ == "__main__":
    main()
