"""Throughput benchmark, part 1: workloads, checkpoints, prompts and instrumentation.

Shared by `throughput.py` (the peers) and `decode_profile.py` (decode time against length).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ringserve.engine import LLM  # noqa: E402

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
    the LM head), and the host side (everything else: scheduling, `planner.plan` and
    `runner.prepare`, the
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
    # the step's host-side preparation: the planner's appends, then the runner's tensors
    prepared: list[float] = []
    engine.planner.plan = _timed(engine.planner.plan, prepared)  # type: ignore[method-assign]
    prepare = _timed(engine.runner.prepare, prepared)

    def timed_prepare(plan: Any) -> Any:
        out = prepare(plan)
        log.prepare.append(prepared.pop() + prepared.pop())
        return out

    engine.runner.prepare = timed_prepare  # type: ignore[method-assign]
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
    """Bytes of KV a sequence holds now: its blocks in every layer group x bytes per block."""
    kv = llm.engine.kv
    return sum(len(blocks) for blocks in kv.block_tables(seq_id)) * kv.spec.block_bytes


def full_cache_bytes(llm: LLM, num_tokens: int) -> int:
    """Bytes a full (non-ring) paged cache of the same layers holds for `num_tokens`."""
    spec = llm.engine.kv.spec
    blocks = -(-num_tokens // spec.block_size)
    return blocks * len(spec.groups) * spec.block_bytes


def record_release(llm: LLM) -> list[tuple[int, int]]:
    """(KV bytes held, tokens stored) of every sequence when its blocks are released."""
    kv, seen = llm.engine.kv, []
    release = kv.release

    def wrapped(seq_id: Any) -> None:
        seen.append((kv_bytes(llm, seq_id), kv.num_tokens(seq_id)))
        release(seq_id)

    kv.release = wrapped  # type: ignore[method-assign]
    return seen


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


# -- decode time against length, ring beside full ------------------------------------------


def make_llm(path: Path, max_model_len: int, kv_memory: str = "1GiB") -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", block_size=16,
               kv_cache_memory=kv_memory, max_num_seqs=64, max_num_batched_tokens=2048,
               max_model_len=max_model_len)  # fmt: skip
