"""Accuracy of a served variant under teacher forcing: its logits at every position of a
real text against a reference variant's (by default bfloat16 against float32).

Each variant is exactly the served path: the model that `LLM(model, dtype=..., **kwargs)`
loads (`llm.engine.model`), fed the text through ring KV caches in prefill chunks
(`tests.model_harness.teacher_forced_logits`: NaN-poisoned caches, every read checked), so
with gemma-3-270m (window 512) and chunks of 256 the ring wraps. Reported per variant:
top-1 agreement with the reference, perplexity of the text's next tokens, its ratio to the
reference's, max / mean |logit difference| and the mean KL(reference || variant).

    python benchmarks/accuracy.py                        # gemma-3-270m, the seed article
    python benchmarks/accuracy.py --dtypes float32,bfloat16 --tokens 1100 --json acc.json
    python benchmarks/accuracy.py --variant int8:quantization=int8,dtype=bfloat16

A `--variant NAME:KEY=VALUE,...` passes its keys to `LLM(...)` as extra keyword arguments
(values read as JSON when they parse, else as strings); without `dtype=` it takes the
reference's dtype. The key `cpu_isa=CLASS` (portable, avx2, avx512, avx512_bf16) serves that
variant as a CPU of that class would (`kernels.cpu_isa`: its kernel variant, its oneDNN
packing, its auto dtype), so one machine measures the AVX2 path beside its own:

    python benchmarks/accuracy.py --variant 'avx2-gguf:cpu_isa=avx2,quantization=gguf'

On such a CPU, `--reference 'f32:int16_activations=off,kv_cache_dtype=float32'` makes the
reference plain float32 again (the default float32 there rounds activations to int16).

Goal of the bf16 issue: top-1 >= 99%, perplexity within 1%.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ringserve.engine import LLM  # noqa: E402
from ringserve.engine.loading import load_tokenizer, resolve_model  # noqa: E402
from ringserve.engine.models import CausalLM  # noqa: E402
from ringserve.kernels import cpu_isa  # noqa: E402
from tests.model_harness import teacher_forced_logits  # noqa: E402

SEED_DIR = ROOT.parent / "shared" / "seed"


@dataclass(frozen=True, kw_only=True)
class Agreement:
    """How a variant's next-token logits compare with the reference's on the same tokens.

    Attributes:
        positions: rows compared (each predicts one target token).
        top1: fraction of rows whose argmax equals the reference's.
        ppl_ref, ppl_test: perplexity of the targets (exp of the mean next-token NLL).
        ppl_ratio: ppl_test / ppl_ref.
        max_abs_diff, mean_abs_diff: of the logits, over every row and vocabulary entry.
        kl: mean KL(reference || variant) per row, in nats.
    """

    positions: int
    top1: float
    ppl_ref: float
    ppl_test: float
    ppl_ratio: float
    max_abs_diff: float
    mean_abs_diff: float
    kl: float


def compare_logits(ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor,
                   rows_per_pass: int = 64) -> Agreement:
    """Compare two [positions, vocab] logit tensors whose row i predicts ``targets[i]``.

    Args:
        ref: the reference's logits.
        test: the variant's logits, same shape.
        targets: [positions] token ids (for teacher forcing: the text shifted by one).
        rows_per_pass: rows converted to float32 at once (bounds the memory a 262k vocab takes).

    Raises:
        ValueError: shapes that do not line up, or no rows.
    """
    if ref.ndim != 2 or ref.shape != test.shape or targets.shape != ref.shape[:1]:
        raise ValueError(f"need ref, test [n, vocab] and targets [n]; got {tuple(ref.shape)}, "
                         f"{tuple(test.shape)}, {tuple(targets.shape)}")
    n = ref.shape[0]
    if n == 0:
        raise ValueError("no positions to compare")
    agree, nll_ref, nll_test, kl, abs_sum, abs_max = 0, 0.0, 0.0, 0.0, 0.0, 0.0
    for i in range(0, n, rows_per_pass):
        r, t = ref[i : i + rows_per_pass].float(), test[i : i + rows_per_pass].float()
        y = targets[i : i + rows_per_pass].long()
        agree += int((r.argmax(-1) == t.argmax(-1)).sum())
        nll_ref += float(F.cross_entropy(r, y, reduction="sum"))
        nll_test += float(F.cross_entropy(t, y, reduction="sum"))
        kl += float(F.kl_div(t.log_softmax(-1), r.log_softmax(-1), log_target=True,
                             reduction="sum"))
        diff = (r - t).abs()
        abs_sum += float(diff.sum(dtype=torch.float64))
        abs_max = max(abs_max, float(diff.max()))
    ppl_ref, ppl_test = math.exp(nll_ref / n), math.exp(nll_test / n)
    return Agreement(positions=n, top1=agree / n, ppl_ref=ppl_ref, ppl_test=ppl_test,
                     ppl_ratio=ppl_test / ppl_ref, max_abs_diff=abs_max,
                     mean_abs_diff=abs_sum / ref.numel(), kl=kl / n)


@dataclass(frozen=True)
class Variant:
    """A way to serve the model: a name and the keyword arguments `LLM(...)` gets."""

    name: str
    llm_kwargs: dict[str, Any]


def parse_variant(spec: str) -> Variant:
    """``NAME:KEY=VALUE,...`` (or just ``NAME``) -> Variant; values are JSON if they parse."""
    name, _, rest = spec.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"variant {spec!r} has no name (NAME:KEY=VALUE,...)")
    kwargs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"variant {spec!r}: {item!r} is not KEY=VALUE")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return Variant(name, kwargs)


def text_tokens(tokenizer: Any, text: str, count: int) -> list[int]:
    """The first ``count`` tokens of ``text``, starting with BOS when the tokenizer has one."""
    ids: list[int] = tokenizer(text)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    if len(ids) < count:
        raise ValueError(f"the text has {len(ids)} tokens; --tokens asks for {count}")
    return ids[:count]


def served_model(path: Path, variant: Variant, max_len: int,
                 block_size: int) -> tuple[CausalLM, torch.dtype]:
    """The model ``LLM(path, **variant.llm_kwargs)`` loads and serves (on the CPU), and the
    dtype of its KV cache."""
    kwargs = {k: v for k, v in variant.llm_kwargs.items() if k != "cpu_isa"}
    llm = LLM(model=str(path), **{"device": "cpu", "block_size": block_size,
                                  "kv_cache_memory": "256MiB", "max_num_seqs": 1,
                                  "max_model_len": max_len, **kwargs})
    return llm.engine.model, llm.engine.kv_dtype


@contextlib.contextmanager
def cpu_class(name: str | None) -> Iterator[None]:
    """Serve as a CPU of class ``name`` (None: this CPU's) while the block runs."""
    if name is None:
        yield
        return
    real = cpu_isa.info
    capped = dataclasses.replace(real(), cls=cpu_isa.parse_cap(name) or real().cls)
    cpu_isa.info = lambda: capped  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_isa.info = real  # type: ignore[assignment]


def variant_logits(path: Path, variant: Variant, tokens: list[int], chunk: int,
                   block_size: int) -> torch.Tensor:
    """Logits at every position of ``tokens`` through the model the variant's LLM serves."""
    with cpu_class(variant.llm_kwargs.get("cpu_isa")):
        model, kv_dtype = served_model(path, variant, len(tokens) + 1, block_size)
        return teacher_forced_logits(model, tokens, chunk, block_size, kv_dtype)


def run(model: str, text: str, variants: list[Variant], *, tokens: int, chunk: int,
        block_size: int = 16, cache_dir: str | None = None) -> dict[str, Any]:
    """Every variant against the first; returns the report as a JSON-ready dict."""
    resolved = resolve_model(model, cache_dir=cache_dir)
    ids = text_tokens(load_tokenizer(resolved.path), text, tokens)
    targets = torch.tensor(ids[1:])
    report: dict[str, Any] = {"model": model, "path": str(resolved.path), "tokens": len(ids),
                              "chunk": chunk, "block_size": block_size,
                              "reference": variants[0].name, "variants": {}}
    ref: torch.Tensor | None = None
    for variant in variants:
        start = time.perf_counter()
        logits = variant_logits(resolved.path, variant, ids, chunk, block_size)[:-1]
        entry: dict[str, Any] = {"llm_kwargs": variant.llm_kwargs,
                                 "seconds": round(time.perf_counter() - start, 1)}
        if ref is None:
            ref = logits
            entry["ppl"] = math.exp(float(F.cross_entropy(logits, targets)))
        else:
            entry.update(dataclasses.asdict(compare_logits(ref, logits, targets)))
        report["variants"][variant.name] = entry
        del logits
    return report


def print_report(report: dict[str, Any]) -> None:
    """The report as a small table."""
    print(f"model {report['model']} ({report['path']}); {report['tokens']} tokens, prefill "
          f"chunks of {report['chunk']}, block {report['block_size']}; teacher forcing")
    ref = report["reference"]
    print(f"{'variant':<12} {'top-1 vs ' + ref:>19} {'ppl':>9} {'ppl / ref':>9} "
          f"{'max |dlogit|':>12} {'mean |dlogit|':>13} {'KL (nats)':>10} {'s':>6}")
    for name, v in report["variants"].items():
        if name == ref:
            print(f"{name:<12} {'(reference)':>19} {v['ppl']:>9.4f} {'':>9} {'':>12} {'':>13} "
                  f"{'':>10} {v['seconds']:>6.1f}")
            continue
        top1 = f"{100 * v['top1']:.2f}% ({round(v['top1'] * v['positions'])}/{v['positions']})"
        print(f"{name:<12} {top1:>19} {v['ppl_test']:>9.4f} {v['ppl_ratio']:>9.5f} "
              f"{v['max_abs_diff']:>12.4f} {v['mean_abs_diff']:>13.5f} {v['kl']:>10.2e} "
              f"{v['seconds']:>6.1f}")


def default_text() -> Path | None:
    files = sorted(SEED_DIR.glob("*.txt"))
    return files[0] if files else None


def variants_of(dtypes: list[str], reference: Variant | None,
                extra: list[Variant]) -> list[Variant]:
    """The run's variants, the reference first: one per dtype (the first replaced by
    ``reference``, in that dtype unless it names one), then ``extra`` in the first dtype
    unless they name one."""
    variants = [Variant(d, {"dtype": d}) for d in dtypes]
    if reference is not None:
        variants[0] = Variant(reference.name, {"dtype": dtypes[0], **reference.llm_kwargs})
    return variants + [Variant(v.name, {"dtype": dtypes[0], **v.llm_kwargs}) for v in extra]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m", help="preset, HF folder or .gguf")
    parser.add_argument("--text", type=Path, default=None,
                        help=f"UTF-8 text file (default: the first of {SEED_DIR}/*.txt)")
    parser.add_argument("--tokens", type=int, default=1100, help="tokens of the text, BOS included")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated; the first is the reference")
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        help="NAME:KEY=VALUE,... extra LLM kwargs (repeatable)")
    parser.add_argument("--reference", type=parse_variant, default=None,
                        help="NAME:KEY=VALUE,... the reference's own LLM kwargs (default: the "
                             "first dtype's defaults, which on a CPU without bf16 arithmetic "
                             "are int16 activations and a bf16 KV cache)")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk, tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-dir", default=None, help="where presets are converted")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    text_file = args.text or default_text()
    if text_file is None:
        parser.error(f"no text: {SEED_DIR} has no *.txt; pass --text FILE")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes:
        parser.error("--dtypes names no dtype")
    variants = variants_of(dtypes, args.reference, args.variant)
    if len({v.name for v in variants}) != len(variants) or len(variants) < 2:
        parser.error("need at least two variants with distinct names")
    report = run(args.model, text_file.read_text(encoding="utf-8"), variants, tokens=args.tokens,
                 chunk=args.chunk, block_size=args.block_size, cache_dir=args.cache_dir)
    report["text"] = str(text_file)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
