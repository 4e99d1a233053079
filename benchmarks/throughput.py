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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402

CACHE = ROOT / ".cache" / "ringserve-bench"
RESULTS = Path(__file__).resolve().parent / "results"
GEMMA_TEXT = (
    "Once upon a time, there was a little girl named Lily. She lived in a small house near "
    "the forest with her mother, her father and a very old dog called Max. Every morning she "
    "walked to the river to watch the fish and the birds, and every evening she told her "
    "mother what she had seen. One day, something strange happened at the river: the water "
    "turned bright blue, and a tiny boat with a red sail floated towards her. Inside the "
    "boat there was a letter, folded twice and sealed with wax, with her name written on it "
    "in golden ink. Lily looked around, but nobody was there."
)


# -- workloads and models ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Synthetic:
    """A Mistral-style SWA config sized like a small real model (~57M parameters)."""

    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1536
    vocab: int = 32000
    window: int = 128

    def hf_config(self, window: int | None) -> transformers.MistralConfig:
        return transformers.MistralConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim, sliding_window=window,
            max_position_embeddings=32 * 1024, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=None, pad_token_id=0)  # fmt: skip

    def describe(self) -> str:
        attention = 2 * self.hidden * (self.heads + self.kv_heads) * self.head_dim
        layer = attention + 3 * self.hidden * self.intermediate
        params = 2 * self.vocab * self.hidden + self.layers * layer  # untied embeddings
        return (f"{params / 1e6:.0f}M params: hidden {self.hidden}, {self.layers} layers, "
                f"{self.heads} q / {self.kv_heads} kv heads of {self.head_dim}, MLP "
                f"{self.intermediate}, vocab {self.vocab}, every layer sliding w={self.window}")

    @property
    def name(self) -> str:
        return (f"mistral-h{self.hidden}-l{self.layers}-q{self.heads}-kv{self.kv_heads}"
                f"-v{self.vocab}-w{self.window}")


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    path: Path
    window: int
    prompts: list[list[int]]
    output_len: int
    note: str = ""


def word_tokenizer(vocab: int) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer with one made-up word per id, so every id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token="w0", pad_token="w0", bos_token="w1", eos_token="w2")


def synthetic_checkpoints(spec: Synthetic) -> tuple[Path, Path]:
    """The SWA checkpoint and its full-attention twin (same weights), saved once under .cache."""
    ring, full = CACHE / spec.name, CACHE / f"{spec.name}-full"
    if not (ring / "config.json").is_file():
        torch.manual_seed(0)
        model = transformers.MistralForCausalLM(spec.hf_config(spec.window))
        model.generation_config.eos_token_id = None
        tmp = ring.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.redirect_stderr(io.StringIO()):  # progress bars
            model.save_pretrained(tmp)
        word_tokenizer(spec.vocab).save_pretrained(tmp)
        tmp.rename(ring)
    if not (full / "config.json").is_file():
        tmp = full.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(ring, tmp, copy_function=os.link)  # hard links: no second copy
        (tmp / "config.json").unlink()  # NOTE: unlink first, the link shares the inode
        spec.hf_config(None).to_json_file(tmp / "config.json")
        tmp.rename(full)
    return ring, full


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def text_prompts(path: Path, n: int, length: int) -> list[list[int]]:
    """BOS + windows of one English paragraph at different offsets (real text for Gemma)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok(GEMMA_TEXT).input_ids
    bos, body = ids[:1], ids[1:]
    if len(body) < length + n:
        raise ValueError(f"the Gemma paragraph is {len(body)} tokens; need {length + n}")
    return [bos + body[i : i + length - 1] for i in range(n)]


# -- measuring -----------------------------------------------------------------------------


def probe_gflops(seconds: float = 0.5) -> float:
    """fp32 matmul GFLOP/s right now: a gauge of how much CPU this process is getting."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    torch.mm(a, b)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        n += 1
    return n * 2 * 512**3 / (time.perf_counter() - start) / 1e9


def load_average() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "n/a"


@dataclass
class StepLog:
    """Per engine step: wall time and the parts of it spent in the model."""

    total: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    logits: list[float] = field(default_factory=list)
    prepare: list[float] = field(default_factory=list)
    sample: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # tokens fed (== seqs for decode-only)
    seqs: list[int] = field(default_factory=list)

    def host(self, i: int) -> float:
        return self.total[i] - self.forward[i] - self.logits[i]

    def decode_steps(self) -> list[int]:
        return [i for i, (t, s) in enumerate(zip(self.tokens, self.seqs, strict=True))
                if t == s and s > 0]  # fmt: skip


def _timed(fn: Callable[..., Any], sink: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    return wrapper


class _TimedSampler:
    def __init__(self, sampler: Any, sink: list[float]) -> None:
        self._sampler, self._call = sampler, _timed(sampler.__call__, sink)

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


def instrument(llm: LLM) -> StepLog:
    """Time each engine step and its parts, by wrapping the engine's own objects.

    `step` is split into: model forward (`runner.model(...)`), logits (`compute_logits`:
    the LM head), and the host side (everything else: scheduling, `runner.prepare`, the
    sampler, bookkeeping, detokenization); `prepare` and the sampler are also timed alone.
    """
    log = StepLog()
    engine = llm.engine
    starts: list[float] = []
    model = engine.runner.model
    model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
    model.register_forward_hook(
        lambda *_: log.forward.append(time.perf_counter() - starts.pop()))
    model.compute_logits = _timed(model.compute_logits, log.logits)  # type: ignore[method-assign]
    engine.runner.prepare = _timed(engine.runner.prepare, log.prepare)  # type: ignore[method-assign]
    engine.sampler = _TimedSampler(engine.sampler, log.sample)  # type: ignore[assignment]
    schedule = engine.scheduler.schedule

    def scheduled() -> Any:
        out = schedule()
        log.tokens.append(sum(s.num_new for s in out.scheduled))
        log.seqs.append(len(out.scheduled))
        return out

    engine.scheduler.schedule = scheduled  # type: ignore[method-assign]
    step = engine.step

    def timed_step() -> Any:
        n = len(log.forward)
        result = _timed(step, log.total)()
        if len(log.forward) == n:  # an empty step: keep the lists aligned
            for sink in (log.forward, log.logits, log.prepare, log.sample):
                sink.append(0.0)
        return result

    engine.step = timed_step  # type: ignore[method-assign]
    return log


def kv_bytes(llm: LLM, seq_id: int) -> int:
    """Bytes of KV a sequence holds now: its blocks per layer group x bytes per block."""
    kv = llm.engine.kv
    return sum(len(blocks) * kv.spec.bytes_per_block(g)
               for g, blocks in enumerate(kv.block_tables(seq_id)))  # fmt: skip


def full_cache_bytes(llm: LLM, num_tokens: int) -> int:
    """Bytes a full (non-ring) paged cache of the same layers holds for `num_tokens`."""
    spec = llm.engine.kv.spec
    blocks = -(-num_tokens // spec.block_size)
    return sum(blocks * spec.bytes_per_block(g) for g in range(len(spec.groups)))


def record_release(llm: LLM) -> list[tuple[int, int]]:
    """(KV bytes held, tokens stored) of every sequence when its blocks are released."""
    kv, seen = llm.engine.kv, []
    release = kv.release

    def wrapped(seq_id: Any) -> None:
        seen.append((kv_bytes(llm, seq_id), kv.num_tokens(seq_id)))
        release(seq_id)

    kv.release = wrapped  # type: ignore[method-assign]
    return seen


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


def make_llm(path: Path, max_model_len: int, kv_memory: str = "1GiB") -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", block_size=16,
               kv_cache_memory=kv_memory, max_num_seqs=64, max_num_batched_tokens=2048,
               max_model_len=max_model_len)  # fmt: skip


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


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


# -- decode time against length, ring beside full ------------------------------------------


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
