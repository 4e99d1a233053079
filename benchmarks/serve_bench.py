"""Load a running ringserve (or any OpenAI-compatible server) over HTTP, streaming.

Sends ``--num-prompts`` completion requests of ``--input-len`` random token ids and
``--output-len`` forced output tokens (``ignore_eos``), at most ``--concurrency`` in flight,
and reports what `vllm bench serve` reports: request and token throughput, TTFT, TPOT and
ITL (mean, median, p99) in milliseconds.

    ringserve serve --model gemma-3-270m &          # or: make serve
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    status: int = 0  # the HTTP status, once a response began
    retried: int = 0  # sent again after the server closed a reused connection unanswered


async def one_request(client: httpx.AsyncClient, url: str, model: str | None,
                      prompt: list[int], output_len: int, temperature: float = 0.0
                      ) -> Result:
    body = {"prompt": prompt, "max_tokens": output_len, "stream": True, "ignore_eos": True,
            "temperature": temperature, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    retried = 0
    while True:
        res = await _one_attempt(client, url, body)
        res.retried = retried
        # NOTE: a keep-alive connection the server closed as we reused it fails before any
        # response ("Server disconnected without sending a response"): the server never saw
        # the request (llama-server's log has no task for it), so it is sent once more on a
        # fresh connection, as urllib3 and browsers do, instead of counting as a failure.
        if res.ok or retried or res.status or not res.error.startswith("RemoteProtocolError"):
            return res
        retried = 1


async def _one_attempt(client: httpx.AsyncClient, url: str, body: dict[str, object]
                       ) -> Result:
    res = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    continue
                if not chunk.get("choices"):
                    continue
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0
    except httpx.HTTPError as err:
        res.error = repr(err)
    return res


def _ms(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (0.0, 0.0, 0.0)
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (1000 * statistics.fmean(values), 1000 * statistics.median(values), 1000 * p99)


def report(results: list[Result], duration: float, input_len: int) -> None:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    line = "{:<40}{:<10}"
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    print(line.format("Successful requests:", len(ok)))
    print(line.format("Failed requests:", len(results) - len(ok)))
    print(line.format("Benchmark duration (s):", f"{duration:.2f}"))
    print(line.format("Total input tokens:", input_len * len(ok)))
    print(line.format("Total generated tokens:", out_tokens))
    print(line.format("Request throughput (req/s):", f"{len(ok) / duration:.2f}"))
    print(line.format("Output token throughput (tok/s):", f"{out_tokens / duration:.2f}"))
    print(line.format("Total token throughput (tok/s):",
                      f"{(out_tokens + input_len * len(ok)) / duration:.2f}"))
    for name, values in (("TTFT", [r.ttft for r in ok]), ("TPOT", tpot),
                         ("ITL", [x for r in ok for x in r.itl])):
        mean, median, p99 = _ms(values)
        print("{s:{c}^50}".format(s=f" {name} ", c="-"))
        print(line.format(f"Mean {name} (ms):", f"{mean:.2f}"))
        print(line.format(f"Median {name} (ms):", f"{median:.2f}"))
        print(line.format(f"P99 {name} (ms):", f"{p99:.2f}"))
    print("=" * 50)
    retried = sum(1 for r in results if r.retried)
    if retried:
        print(f"resent on a fresh connection (the server closed a reused one): {retried}")
    for r in results:
        if not r.ok:
            print("error:", r.error)
            break


async def run(args: argparse.Namespace) -> tuple[list[Result], float]:
    """Load the server as `args` says, print the report, return each request's result and
    the wall time of the whole load in seconds."""
    rng = random.Random(args.seed)
    vocab = args.vocab_low, args.vocab_high
    prompts = [[rng.randrange(*vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:

        async def guarded(p: list[int]) -> Result:
            async with gate:
                return await one_request(client, args.url, args.model, p, args.output_len,
                                         getattr(args, "temperature", 0.0))

        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        duration = time.perf_counter() - start
    report(results, duration, args.input_len)
    return results, duration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: none)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-low", type=int, default=100)
    parser.add_argument("--vocab-high", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 decodes greedily; OpenAI's default is 1")
    parser.add_argument("--timeout", type=float, default=600.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
