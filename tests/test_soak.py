"""A soak: 2,000 mixed requests against one real server process, over loopback.

Streamed and plain completions and chats (shared prefixes, so the prefix cache hits; some
sampled, some with n=2, logprobs, stop strings, JSON mode), 10% dropped by the client
mid-generation, some over-long and some malformed. Every well-formed request must complete,
the bad ones get 400 with OpenAI's error body, the server's RSS after warm-up grows < 5%,
and at the end no KV block is held and no ring read missed.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.server_utils import Server, run_server
from tests.tiny_models import make_checkpoint

# gemma3_text mixes sliding and full layers; the default prefix caching is on.
MAX_LEN = 512
FLAGS = ("--block-size", "4", "--kv-cache-memory", "8MiB", "--max-model-len", str(MAX_LEN),
         "--max-num-seqs", "32", "--max-num-batched-tokens", "256")
TOTAL, WARMUP, CONCURRENCY = 2000, 500, 12
WORDS = ["the", "ring", "keeps", "a", "window", "of", "tokens", "and", "recycles", "its",
         "oldest", "block", "while", "scheduler", "admits", "requests", "against", "an",
         "exact", "budget", "blocks"]
PREFIXES = [" ".join(random.Random(i).choices(WORDS, k=16)) for i in range(6)]
MALFORMED: list[bytes] = [
    b'{"prompt": "unterminated',
    b'{"prompt": 5, "max_tokens": 4}',
    b'{"prompt": "x", "max_tokens": "many"}',
    b'{"prompt": "x", "temperature": -1}',
    b'{"messages": "hello", "max_tokens": 4}',
    b'{"prompt": "x", "n": 0}',
    b'[1, 2, 3]',
    b'{"prompt": "x", "max_tokens": 4, "no_such_field": true}',
]

pytestmark = pytest.mark.slow


@dataclass
class Job:
    kind: str
    route: str
    body: bytes
    stream: bool = False


def jobs(rng: random.Random) -> Iterator[Job]:
    """The soak's requests, in order: a fixed mix drawn from ``rng``."""
    for i in range(TOTAL):
        r = rng.random()
        prompt = f"{rng.choice(PREFIXES)} {i} " + " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
        sampling: dict[str, Any] = {"max_tokens": rng.randint(1, 24),
                                    "temperature": rng.choice([0, 0, 0.8]), "seed": i}
        if rng.random() < 0.15:
            sampling["n"] = 2
        if rng.random() < 0.1:
            sampling["stop"] = [rng.choice(WORDS)]
        chat = rng.random() < 0.4
        route = "/v1/chat/completions" if chat else "/v1/completions"
        body: dict[str, Any] = ({"messages": [{"role": "user", "content": prompt}]} if chat
                                else {"prompt": prompt})
        if rng.random() < 0.1:
            body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
        if rng.random() < 0.03:
            body["response_format"] = {"type": "json_object"}
        if r < 0.05:  # a stream the client leaves after its first chunk
            body.update(max_tokens=200, ignore_eos=True, stream=True, n=1)
            yield Job("drop_stream", route, json.dumps(body).encode(), stream=True)
        elif r < 0.10:  # a plain request the client gives up on while it runs
            body.update(max_tokens=200, ignore_eos=True, n=1)
            yield Job("drop_plain", route, json.dumps(body).encode())
        elif r < 0.14:  # too long: the prompt or the requested output
            if rng.random() < 0.5:
                body = {"prompt": list(range(3, 3 + MAX_LEN + 10)), "max_tokens": 4}
                route = "/v1/completions"
            else:
                body.update(sampling, max_tokens=MAX_LEN * 2)
            yield Job("overlong", route, json.dumps(body).encode())
        elif r < 0.18:
            yield Job("malformed", rng.choice(["/v1/completions", "/v1/chat/completions"]),
                      rng.choice(MALFORMED))
        else:
            body.update(sampling)
            stream = rng.random() < 0.4
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
            yield Job("ok", route, json.dumps(body).encode(), stream=stream)


def check_error(r: httpx.Response) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error", error


def check_plain(body: dict[str, Any], n: int) -> None:
    choices = body["choices"]
    assert sorted(c["index"] for c in choices) == list(range(n))
    assert all(c["finish_reason"] in ("stop", "length") for c in choices), choices


async def run_job(client: httpx.AsyncClient, url: str, job: Job) -> str:
    """Send one job and check its answer; returns what happened."""
    headers = {"Content-Type": "application/json"}
    n = json.loads(job.body).get("n", 1) if job.kind == "ok" else 1
    if job.kind == "drop_plain":
        try:
            await asyncio.wait_for(client.post(url + job.route, content=job.body,
                                               headers=headers), timeout=0.2)
        except TimeoutError:
            return "dropped"
        return "finished before the drop"
    if not job.stream:
        r = await client.post(url + job.route, content=job.body, headers=headers)
        if job.kind in ("overlong", "malformed"):
            check_error(r)
            return "rejected"
        assert r.status_code == 200, r.text
        check_plain(r.json(), n)
        return "completed"
    async with client.stream("POST", url + job.route, content=job.body,
                             headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        finish: dict[int, str] = {}
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if job.kind == "drop_stream":
                return "dropped"  # leaving the block closes the connection
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                if c.get("finish_reason"):
                    finish[c["index"]] = c["finish_reason"]
        assert done and sorted(finish) == list(range(n)), (done, finish)
        assert set(finish.values()) <= {"stop", "length"}, finish
        return "completed"


def rss_bytes(server: Server) -> int:
    status = pathlib.Path(f"/proc/{server.process.pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


async def soak(url: str, all_jobs: list[Job], server: Server
               ) -> tuple[Counter[str], int, dict[str, float]]:
    outcomes: Counter[str] = Counter()
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(job: Job) -> None:
            async with gate:
                outcomes[f"{job.kind}: {await run_job(client, url, job)}"] += 1

        await asyncio.gather(*(one(j) for j in all_jobs[:WARMUP]))
        warm_stats = await settle(server)
        warm = rss_bytes(server)
        await asyncio.gather(*(one(j) for j in all_jobs[WARMUP:]))
    return outcomes, warm, warm_stats


async def settle(server: Server) -> dict[str, float]:
    """The server's metrics once the aborts of dropped requests have gone through."""
    stats: dict[str, float] = {}
    for _ in range(100):
        stats = await asyncio.to_thread(server.stats)
        if stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0:
            break
        await asyncio.sleep(0.1)
    return stats


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ckpt = make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"), eos=True)
    with run_server(ckpt, *FLAGS, log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s


def test_soak_2000_mixed_requests(server: Server) -> None:
    all_jobs = list(jobs(random.Random(2026)))
    kinds = Counter(j.kind for j in all_jobs)
    assert kinds["drop_stream"] + kinds["drop_plain"] >= 0.08 * TOTAL, kinds
    start = time.monotonic()
    outcomes, warm, warm_stats = asyncio.run(
        asyncio.wait_for(soak(server.url, all_jobs, server), 900))
    # Warm means steady: every block of the pool has been filled and kept by the prefix
    # cache once, so its index is as large as it gets.
    assert warm_stats["prefix_cache_blocks"] >= 0.95 * warm_stats["kv_blocks_total"], warm_stats
    took = time.monotonic() - start
    end = rss_bytes(server)
    stats = asyncio.run(settle(server))
    print(f"soak: {TOTAL} requests in {took:.0f} s; RSS {warm / 2**20:.0f} MiB after "
          f"warm-up -> {end / 2**20:.0f} MiB; {dict(outcomes)}")
    assert sum(outcomes.values()) == TOTAL
    assert outcomes["ok: completed"] == kinds["ok"]  # every well-formed request completed
    assert outcomes["overlong: rejected"] == kinds["overlong"]
    assert outcomes["malformed: rejected"] == kinds["malformed"]
    assert outcomes["drop_stream: dropped"] == kinds["drop_stream"]
    assert outcomes["drop_plain: dropped"] >= 0.8 * kinds["drop_plain"], outcomes
    assert end < warm * 1.05, (warm, end)
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0, stats
    assert stats["kv_read_misses_total"] == 0 and stats["num_preemptions_total"] == 0, stats
    assert stats["prefix_cache_hits_total"] > 0  # the shared prefixes were reused
    assert "Traceback" not in server.log.read_text()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "still here",
                                                         "max_tokens": 4}, timeout=30)
    assert r.status_code == 200
