"""Headline benchmark (issue #5): ringserve against transformers on sliding-window models.

One run, same model, same prompts, greedy with every request running its full length, fp32,
2 threads, block / page size 16:

1. ringserve `LLM.generate` (continuous batching over the ring KV cache);
2. transformers `generate_batch` (its continuous batching: paged, ring for sliding layers);
3. transformers `generate` on static batches, by default one batch of every request: the
   prompts have equal lengths and every request generates the same number of tokens, so
   this needs no padding and wastes no step (static batching's best case).

on two models: a synthetic Mistral-style SWA model (random weights saved with
`save_pretrained` beside a word-level tokenizer, under .cache/ringserve-bench/), each request
generating 8w tokens, and the real `gemma-3-270m` preset, scaled down (see `--gemma-*`).

The three peers run in their own processes and take turns of `--slice` seconds (SIGSTOP /
SIGCONT), so load from other work on a shared machine falls on all of them alike; each
peer's time counts only its turns. Each also reports its median decode step, which bursts of
load barely move. Absolute numbers still vary from run to run; the ratios are the result.

On the synthetic model it also measures ringserve's decode step time at sequence lengths w
and 16w (a fresh cohort decoding through w, stepped alternately with the long cohort
decoding through 16w, so both medians see the same load), KV bytes held per sequence, host
overhead per step (step time minus model forward and LM head), and draws
`results/ring_vs_full.png`: KV bytes and step time against sequence length for the ring
beside the same engine serving a full-attention copy of the model (same weights,
`sliding_window=None`), the two stepped alternately.

    python benchmarks/throughput.py --save benchmarks/results/throughput.txt   # ~12 min
    python benchmarks/throughput.py --quick                                    # ~1.5 min
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from bench_setup import (
    RESULTS,
    Synthetic,
    Workload,
    full_cache_bytes,
    instrument,
    load_average,
    make_llm,
    mib,
    probe_gflops,
    random_prompts,
    record_release,
    synthetic_checkpoints,
    text_prompts,
)
from decode_profile import (
    decode_profile,
    draw,
    print_decode,
)

from ringserve.engine import SamplingParams

# -- the three peers -----------------------------------------------------------------------


@dataclass
class PeerResult:
    """One peer's run: active time, outputs, and its decode step intervals.

    `seconds` counts only the time the peer's process was running (see `race`). `steps` are
    the intervals between consecutive decode steps while every request decodes together:
    their median is robust to bursts of load from other work on the machine.
    """

    name: str
    start: float
    end: float
    tokens: list[list[int]]
    steps: list[float]
    batch: int  # sequences decoding together in a step
    extra: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def tok_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds

    def step_ms(self) -> float:
        return statistics.median(self.steps) * 1e3

    def steady_tok_per_s(self) -> float:
        """Tokens per second at the median decode step."""
        return self.batch / statistics.median(self.steps)


def run_ringserve(work: Workload, ready: Callable[[], None]) -> PeerResult:
    llm = make_llm(work.path, len(work.prompts[0]) + work.output_len + 16)
    params = SamplingParams(max_tokens=work.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in work.prompts[:2]],
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    log, released = instrument(llm), record_release(llm)
    ready()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params)
    end = time.perf_counter()
    decode = log.decode_steps()
    stats = llm.stats()
    kv_end, stored = max(released)  # the last sampled token is never stored
    return PeerResult("ringserve LLM.generate", start, end,
                      [list(o.outputs[0].token_ids) for o in outs],
                      [log.total[i] for i in decode], len(work.prompts), extra={
        "host_ms": statistics.median(log.host(i) for i in decode) * 1e3,
        "prepare_ms": statistics.median(log.prepare[i] for i in decode) * 1e3,
        "sample_ms": statistics.median(log.sample[i] for i in decode) * 1e3,
        "kv_end": kv_end, "kv_full": full_cache_bytes(llm, stored), "stored": stored,
        "recycles": stats["ring_block_recycles"], "preemptions": stats["num_preemptions"],
        "read_misses": stats["kv_read_misses"],
    })  # fmt: skip


def generation_config(n: int, **extra: Any) -> transformers.GenerationConfig:
    """Greedy, exactly `n` new tokens (no end-of-sequence id, min = max)."""
    return transformers.GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,  # type: ignore[no-untyped-call]
                                         eos_token_id=None, pad_token_id=0, **extra)


def load_hf(path: Path) -> Any:
    """transformers' own model for the folder: fp32, its default attention (sdpa)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]


def run_generate_batch(work: Workload, ready: Callable[[], None], page: int = 16) -> PeerResult:
    """transformers' continuous batching, its cache sized explicitly (no 10 s auto-sizing)."""
    model = load_hf(work.path)
    total = len(work.prompts[0]) + work.output_len
    cb = transformers.ContinuousBatchingConfig(
        page_size=page, num_blocks=len(work.prompts) * -(-total // page) + 8,
        max_batch_tokens=2048)
    model.generate_batch(work.prompts[:2], generation_config(4), cb)  # warm-up
    ready()
    start = time.perf_counter()
    res = model.generate_batch(work.prompts, generation_config(work.output_len), cb,
                               record_timestamps=True)
    end = time.perf_counter()
    outs = list(res.values())
    if len(outs) != len(work.prompts) or any(o.error for o in outs):
        raise RuntimeError(f"generate_batch returned {len(outs)} results, errors: "
                           f"{[o.error for o in outs if o.error][:2]}")
    steps = [b - a for o in outs for a, b in itertools.pairwise(o.timestamps or [])]
    return PeerResult("transformers generate_batch", start, end,
                      [list(o.generated_tokens) for o in outs], steps, len(work.prompts),
                      extra={"page_size": page, "num_blocks": cb.num_blocks})  # fmt: skip


@torch.inference_mode()
def run_static(work: Workload, ready: Callable[[], None], batch: int) -> PeerResult:
    """`generate` on fixed batches; equal prompt lengths, so no padding is needed."""
    model = load_hf(work.path)
    prompt_len = len(work.prompts[0])
    model.generate(torch.tensor(work.prompts[:2]), attention_mask=torch.ones(2, prompt_len,
                   dtype=torch.long), generation_config=generation_config(4))  # warm-up
    batch = min(batch, len(work.prompts))
    tokens: list[list[int]] = []
    steps: list[float] = []
    cache_bytes = 0
    ready()
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch):
        ids = torch.tensor(work.prompts[i : i + batch])
        clock = _StepClock()
        config = generation_config(work.output_len, return_dict_in_generate=True)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             stopping_criteria=transformers.StoppingCriteriaList([clock]))
        tokens += out.sequences[:, prompt_len:].tolist()
        steps += [b - a for a, b in itertools.pairwise(clock.times)]
        layers = out.cache.layers
        cache_bytes = sum(t.numel() * t.element_size() for layer in layers
                          for t in (layer.keys, layer.values)) // ids.shape[0]  # fmt: skip
    end = time.perf_counter()
    return PeerResult(f"transformers generate (static, batch {batch})", start, end, tokens,
                      steps, batch, extra={"kv_end": cache_bytes})


class _StepClock(transformers.StoppingCriteria):
    """Never stops; notes the time of every generation step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


PEERS = ("ringserve", "generate_batch", "static")


def peer_main(args: argparse.Namespace) -> None:
    """Child process: load one peer, stop until the parent resumes it, run, write JSON."""
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    spec = json.loads(args.peer_spec.read_text())
    work = Workload(**{**spec["work"], "path": Path(spec["work"]["path"])})

    # NOTE: stdout is the parent's pipe and carries only READY; anything else goes to stderr.
    channel, sys.stdout = sys.stdout, sys.stderr

    def ready() -> None:
        print("READY", file=channel, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent resumes us in turn

    if args.peer == "ringserve":
        result = run_ringserve(work, ready)
    elif args.peer == "generate_batch":
        result = run_generate_batch(work, ready)
    else:
        result = run_static(work, ready, spec["static_batch"])
    args.peer_spec.with_suffix(".out.json").write_text(json.dumps(dataclasses.asdict(result)))


def race(work: Workload, static_batch: int, threads: int, slice_s: float) -> list[PeerResult]:
    """Run the three peers in their own processes, taking turns of `slice_s` seconds.

    Each child loads its model and warms up, then stops itself; the parent resumes one at a
    time (SIGCONT ... SIGSTOP), so load from other work on the machine falls on all peers
    alike. A peer's `seconds` is the time it was running between its own start and end.
    """
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "work.json"
        spec.write_text(json.dumps({"work": {**dataclasses.asdict(work), "path": str(work.path)},
                                    "static_batch": static_batch}))
        procs: dict[str, subprocess.Popen[str]] = {}
        try:
            for name in PEERS:
                child_spec = Path(tmp) / f"{name}.json"
                shutil.copy(spec, child_spec)
                procs[name] = subprocess.Popen(
                    [sys.executable, __file__, "--peer", name, "--peer-spec", str(child_spec),
                     "--threads", str(threads)], stdout=subprocess.PIPE, text=True)
            for name, proc in procs.items():  # they load and warm up side by side
                if proc.stdout is None or proc.stdout.readline().strip() != "READY":
                    raise RuntimeError(f"peer {name} failed before its timed run (see stderr)")
                os.waitpid(proc.pid, os.WUNTRACED)  # wait until it has stopped itself
            turns = _take_turns(procs, slice_s)
            results = []
            for name in PEERS:
                if procs[name].returncode != 0:
                    raise RuntimeError(f"peer {name} exited with {procs[name].returncode}")
                data = json.loads((Path(tmp) / f"{name}.out.json").read_text())
                result = PeerResult(**data)
                # NOTE: perf_counter is CLOCK_MONOTONIC on Linux: one clock for all processes.
                result.seconds = sum(max(0.0, min(b, result.end) - max(a, result.start))
                                     for a, b in turns[name])  # fmt: skip
                results.append(result)
            return results
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _take_turns(procs: dict[str, subprocess.Popen[str]],
                slice_s: float) -> dict[str, list[tuple[float, float]]]:
    """Resume each live child for `slice_s` in turn until all exit; returns run intervals."""
    turns: dict[str, list[tuple[float, float]]] = {name: [] for name in procs}
    live = list(procs)
    while live:
        for name in list(live):
            proc = procs[name]
            begin = time.perf_counter()
            os.kill(proc.pid, signal.SIGCONT)
            try:
                proc.wait(timeout=slice_s if len(live) > 1 else None)
                live.remove(name)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGSTOP)
                os.waitpid(proc.pid, os.WUNTRACED)
            turns[name].append((begin, time.perf_counter()))
    return turns


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """Identical sequences, and the median length of the common greedy prefix."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
              for x, y in zip(a, b, strict=True)]  # fmt: skip
    return f"{same}/{len(a)} identical, median common prefix {statistics.median(prefix):.0f}"


def compare_peers(work: Workload, static_batch: int, args: argparse.Namespace) -> list[PeerResult]:
    """Run the three peers on one workload (taking turns) and print their table."""
    n, p = len(work.prompts), len(work.prompts[0])
    print(f"\n== {work.name}: {n} requests, prompt {p}, output {work.output_len} tokens "
          f"(w = {work.window}; {work.output_len / work.window:g}w), greedy, fp32 ==")
    if work.note:
        print(f"   {work.note}")
    print(f"   before: load average {load_average()}, matmul probe {probe_gflops():.0f} GFLOP/s")
    results = race(work, static_batch, args.threads, args.slice)
    print(f"   after:  load average {load_average()}, matmul probe {probe_gflops():.0f} GFLOP/s")
    for r in results:
        lengths = {len(t) for t in r.tokens}
        if lengths != {work.output_len} or len(r.tokens) != n:
            raise RuntimeError(f"{r.name}: output lengths {lengths}, want {work.output_len}")
    print_peers(results)
    return results


def print_peers(results: list[PeerResult]) -> None:
    ring = results[0]
    print(f"   {'peer':42s} {'tok/s':>7s} {'seconds':>8s} {'step ms':>8s} {'steady tok/s':>13s}")
    for r in results:
        print(f"   {r.name:42s} {r.tok_per_s():7.1f} {r.seconds:8.1f} {r.step_ms():8.1f} "
              f"{r.steady_tok_per_s():13.1f}")
    print("   (tok/s: output tokens / running time of the call, prefill included; step ms: "
          "median decode step; steady tok/s: sequences per step / median step)")
    for r in results[1:]:
        print(f"   ringserve / {r.name}: {ring.tok_per_s() / r.tok_per_s():.2f}x, "
              f"{ring.steady_tok_per_s() / r.steady_tok_per_s():.2f}x steady; "
              f"greedy agreement: {agreement(ring.tokens, r.tokens)}")
    e = ring.extra
    print(f"   ringserve decode steps (batch {ring.batch}): median step {ring.step_ms():.1f} ms, "
          f"host overhead {e['host_ms']:.2f} ms ({100 * e['host_ms'] / ring.step_ms():.1f}%; "
          f"of which prepare {e['prepare_ms']:.2f} ms, sampler {e['sample_ms']:.2f} ms)")
    static = results[2].extra["kv_end"]
    print(f"   KV per sequence at the end ({e['stored']} tokens): ringserve {mib(e['kv_end'])} "
          f"vs a full paged cache {mib(e['kv_full'])} ({e['kv_full'] / e['kv_end']:.1f}x); "
          f"transformers static DynamicCache {mib(static)}")
    print(f"   ring_block_recycles {e['recycles']}, kv_read_misses {e['read_misses']}, "
          f"num_preemptions {e['preemptions']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: w=32, fewer requests")
    ap.add_argument("--requests", type=int, help="synthetic requests (default 32; quick 8)")
    ap.add_argument("--window", type=int, help="synthetic window w (default 128; quick 32)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--static-batch", type=int, help="static generate batch (default: all)")
    ap.add_argument("--decode-batch", type=int, default=4, help="sequences in the 16w run")
    ap.add_argument("--gemma-requests", type=int, help="gemma-3-270m requests (default 8)")
    ap.add_argument("--gemma-tokens", type=int, help="gemma output tokens (default 512 = w)")
    ap.add_argument("--skip-gemma", action="store_true")
    ap.add_argument("--skip-decode", action="store_true", help="no 16w run and no figure")
    ap.add_argument("--figure", type=Path, default=RESULTS / "ring_vs_full.png")
    ap.add_argument("--save", type=Path, help="also write what is printed to this file")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--slice", type=float, default=2.0,
                    help="seconds each peer runs before the next takes its turn")
    ap.add_argument("--peer", choices=PEERS, help=argparse.SUPPRESS)  # child process mode
    ap.add_argument("--peer-spec", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


class _Tee(io.TextIOBase):
    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
            stream.flush()
        return len(text)


def synthetic_workload(args: argparse.Namespace) -> tuple[Synthetic, Workload, Path]:
    spec = Synthetic(window=args.window or (32 if args.quick else 128))
    ring, full = synthetic_checkpoints(spec)
    n = args.requests or (8 if args.quick else 32)
    work = Workload(name=f"synthetic {spec.name} (random weights)", path=ring,
                    window=spec.window, output_len=8 * spec.window, note=spec.describe(),
                    prompts=random_prompts(n, args.prompt_len, spec.vocab))  # fmt: skip
    return spec, work, full


def gemma_workload(args: argparse.Namespace) -> Workload:
    from tests.presets import preset_path

    path = preset_path("gemma-3-270m")
    n = args.gemma_requests or (4 if args.quick else 8)
    tokens = args.gemma_tokens or (32 if args.quick else 512)
    note = (f"SCALED DOWN from 32 requests x 8w = 4096 output tokens to {n} x {tokens}: "
            "131072 tokens per peer is about an hour per peer on 2 CPU cores (270M params, "
            "vocab 262144: a 671 MB fp32 LM head read every step)")
    return Workload(name="gemma-3-270m (real weights, 5 sliding : 1 full layers)", path=path,
                    window=512, prompts=text_prompts(path, n, args.prompt_len),
                    output_len=tokens, note=note)  # fmt: skip


def verdict(results: list[PeerResult]) -> str:
    ring, batch, static = results
    wall = [ring.tok_per_s() / r.tok_per_s() for r in (batch, static)]
    steady = [ring.steady_tok_per_s() / r.steady_tok_per_s() for r in (batch, static)]
    met = ["met" if min(a, b) >= goal else "NOT met"
           for a, b, goal in zip(wall, steady, (2, 4), strict=True)]  # fmt: skip
    return (f"ringserve / generate_batch {wall[0]:.2f}x ({steady[0]:.2f}x steady; goal >= 2: "
            f"{met[0]}); ringserve / static generate {wall[1]:.2f}x ({steady[1]:.2f}x steady; "
            f"goal >= 4: {met[1]})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.peer is not None:
        peer_main(args)
        return
    if args.save is None:
        run(args)
        return
    args.save.parent.mkdir(parents=True, exist_ok=True)
    with args.save.open("w") as out, contextlib.redirect_stdout(_Tee(sys.stdout, out)):
        run(args)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    started = time.perf_counter()
    print(f"ringserve throughput benchmark: torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {torch.get_num_threads()} threads, fp32, greedy, "
          f"block/page size 16, {'QUICK' if args.quick else 'full'} run")
    print(f"load average at start: {load_average()}; matmul probe {probe_gflops():.1f} GFLOP/s")
    spec, work, full_path = synthetic_workload(args)
    peers = compare_peers(work, args.static_batch or len(work.prompts), args)
    summary = [f"synthetic: {verdict(peers)}"]
    if not args.skip_decode:
        d = decode_profile(work.path, full_path, spec, args.decode_batch, args.prompt_len)
        print_decode(d)
        draw(d, args.figure)
        print(f"   figure: {args.figure}")
        ratio = d["at_16w"] / d["at_w"]
        summary.append(f"decode step time 16w / w = {ratio:.3f} (goal <= 1.10: "
                       f"{'met' if ratio <= 1.10 else 'NOT met'})")
    if not args.skip_gemma:
        gemma = gemma_workload(args)
        peers = compare_peers(gemma, args.static_batch or len(gemma.prompts), args)
        summary.append(f"gemma-3-270m: {verdict(peers)}")
    print("\n== summary ==")
    for line in summary:
        print(f"   {line}")
    print(f"   load average at end: {load_average()}; matmul probe {probe_gflops():.1f} GFLOP/s;"
          f" total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
