"""Throughput benchmark, part 2: ringserve's decode step against sequence length, ring
beside a full-attention copy, and the figure `results/ring_vs_full.png`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_setup import (
    Synthetic,
    instrument,
    kv_bytes,
    make_llm,
    mib,
    probe_gflops,
    random_prompts,
)

from ringserve.engine import LLM, SamplingParams


@dataclass
class Curve:
    """One engine's decode steps: context length, step time, KV bytes per sequence."""

    context: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    host_s: list[float] = field(default_factory=list)
    kv: list[int] = field(default_factory=list)


class Runner:
    """Drives one engine step by step, recording each decode step of its cohort."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.log, self.curve = llm, instrument(llm), Curve()
        self.seq_ids: list[int] = []
        self.prompt_len = 0

    def start(self, prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine = self.llm.engine
        reqs = [engine.add_request(f"c{id(self)}-{i}-{time.monotonic_ns()}", p, params)
                for i, p in enumerate(prompts)]  # fmt: skip
        self.seq_ids = [r.seqs[0].seq_id for r in reqs]
        self.prompt_len = len(prompts[0])

    @property
    def busy(self) -> bool:
        return bool(self.llm.engine.has_unfinished)

    def context(self) -> int:
        """Positions the cohort's first sequence has stored (-1 once it has finished)."""
        kv = self.llm.engine.kv
        return kv.num_tokens(self.seq_ids[0]) if self.seq_ids[0] in kv else -1

    def step(self) -> None:
        kv = self.llm.engine.kv
        before = self.context()
        self.llm.engine.step()
        log, i = self.log, len(self.log.total) - 1
        if before <= 0 or log.tokens[i] != log.seqs[i]:
            return  # not a decode step
        c = self.curve
        c.context.append(before)
        c.step_s.append(log.total[i])
        c.host_s.append(log.host(i))
        c.kv.append(kv_bytes(self.llm, self.seq_ids[0]) if self.seq_ids[0] in kv else c.kv[-1])


def median_around(curve: Curve, length: int, half: int) -> float:
    picked = [t for c, t in zip(curve.context, curve.step_s, strict=True)
              if length - half <= c < length + half]  # fmt: skip
    return statistics.median(picked) if picked else float("nan")


def decode_profile(ring_path: Path, full_path: Path, spec: Synthetic, batch: int,
                   prompt_len: int) -> dict[str, Any]:
    """Ring and full engines to 16w + h, stepped alternately; a short cohort at w beside 16w."""
    w, half = spec.window, max(8, min(32, spec.window // 4))
    target = 16 * w + half
    ring, full = Runner(make_llm(ring_path, target + 1)), Runner(make_llm(full_path, target + 1))
    short = Runner(make_llm(ring_path, w + 2 * half + 1))
    prompts = random_prompts(batch, prompt_len, spec.vocab, seed=1)
    for r in (ring, full, short):  # warm-up
        r.llm.generate([{"prompt_token_ids": p[:8]} for p in prompts], SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True))
    ring.start(prompts, target - prompt_len + 1)
    full.start(prompts, target - prompt_len + 1)
    gflops = probe_gflops()
    short_started = False
    while ring.busy or full.busy or short.busy:
        if not short_started and ring.busy and ring.context() >= 16 * w - 2 * half:
            # prefill (w - 2h) tokens now: the short cohort decodes through w while the
            # ring cohort decodes through 16w; their steps alternate.
            short.start(random_prompts(batch, w - 2 * half, spec.vocab, seed=2), 4 * half)
            short_started = True
        for r in (ring, full, short):
            if r.busy:
                r.step()
    at_w, at_16w = median_around(short.curve, w, half), median_around(ring.curve, 16 * w, half)
    return {"ring": ring.curve, "full": full.curve, "at_w": at_w, "at_16w": at_16w,
            "ring_at_w_early": median_around(ring.curve, w, half), "half": half,
            "batch": batch, "window": w, "gflops": gflops, "prompt_len": prompt_len,
            "host_ms": statistics.median(ring.curve.host_s) * 1e3}  # fmt: skip


def print_decode(d: dict[str, Any]) -> None:
    w, h, b = d["window"], d["half"], d["batch"]
    ring, full = d["ring"], d["full"]
    ratio = d["at_16w"] / d["at_w"]
    print(f"\n== decode step time against length (synthetic, batch {b}, prompt "
          f"{ring.context[0]}, to 16w = {16 * w}; probe {d['gflops']:.1f} GFLOP/s) ==")
    print(f"   median step at length w={w} +-{h} (fresh cohort, interleaved): "
          f"{d['at_w'] * 1e3:.2f} ms; at 16w={16 * w} +-{h}: {d['at_16w'] * 1e3:.2f} ms; "
          f"ratio 16w/w = {ratio:.3f} (goal <= 1.10: {'met' if ratio <= 1.10 else 'NOT met'})")
    early = d["ring_at_w_early"]
    if early == early:  # not NaN: the prompt is shorter than w
        print(f"   the long cohort itself at w (earlier in the run, not interleaved): "
              f"{early * 1e3:.2f} ms (ratio {d['at_16w'] / early:.3f})")
    full_16w = median_around(full, 16 * w, h)
    print(f"   full-attention copy at 16w: {full_16w * 1e3:.2f} ms "
          f"({full_16w / d['at_16w']:.2f}x the ring); host overhead per step (ring, batch "
          f"{b}): {d['host_ms']:.2f} ms")
    print(f"   KV per sequence at {ring.context[-1] + 1} tokens: ring {mib(ring.kv[-1])}, "
          f"full {mib(full.kv[-1])} ({full.kv[-1] / ring.kv[-1]:.1f}x)")


def draw(d: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kv_ax, t_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    w = d["window"]
    for curve, label, color in ((d["full"], "full cache (same model, sliding_window=None)",
                                 "tab:red"), (d["ring"], "ringserve ring", "tab:blue")):
        length = [c + 1 for c in curve.context]  # tokens in the sequence after the step
        kv_ax.plot(length, [b / 2**20 for b in curve.kv], color=color, label=label)
        ms = [s * 1e3 for s in curve.step_s]
        t_ax.plot(length, ms, color=color, alpha=0.15, linewidth=0.6)
        t_ax.plot(length, rolling_median(ms, 31), color=color, label=label)
    for ax in (kv_ax, t_ax):
        for k in (1, 8, 16):
            ax.axvline(k * w, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xlabel(f"sequence length (prompt {d['prompt_len']} + generated); dotted: w, 8w, 16w")
        ax.legend(loc="upper left", fontsize=8)
        ax.set_ylim(bottom=0)
    # NOTE: spikes from other work on a shared machine would flatten the curves: cap the axis.
    smooth = sorted(rolling_median([s * 1e3 for s in d["full"].step_s], 31))
    t_ax.set_ylim(0, 1.6 * smooth[int(0.95 * (len(smooth) - 1))])
    kv_ax.set_title("KV bytes held per sequence", fontsize=10)
    kv_ax.set_ylabel("MiB")
    t_ax.set_title(f"decode step time, batch {d['batch']} (thick: rolling median of 31)",
                   fontsize=10)
    t_ax.set_ylabel("ms per step")
    fig.suptitle(f"ringserve, synthetic Mistral-style model, every layer sliding w = {w}; fp32, "
                 f"{torch.get_num_threads()} CPU threads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rolling_median(xs: list[float], k: int) -> list[float]:
    return [statistics.median(xs[max(0, i - k // 2) : i + k // 2 + 1]) for i in range(len(xs))]


# -- main ----------------------------------------------------------------------------------
