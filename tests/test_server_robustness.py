"""The server under hostile or careless clients: fuzzed bodies, dropped streams, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.server_utils import Server, run_server
from tests.tiny_models import make_checkpoint

FLAGS = ("--block-size", "4", "--kv-cache-memory", "4MiB", "--max-model-len", "128",
         "--debug-kv", "--max-num-seqs", "32", "--max-num-batched-tokens", "64")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"), eos=True)


@pytest.fixture(scope="module")
def server(ckpt: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(ckpt, *FLAGS, log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_schema_mismatch(server: Server,
                                                          tmp_path: pathlib.Path) -> None:
    checks = ",".join(["not_a_server_error", "status_code_conformance",
                       "content_type_conformance", "response_schema_conformance",
                       "response_headers_conformance", "negative_data_rejection"])
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
           "--checks", checks, "-n", "12", "--seed", "7", "--request-timeout", "60",
           "--generation-database", "none"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-8000:]
    assert " passed" in out.stdout
    stats = server.stats()
    assert stats["kv_read_misses_total"] == 0


async def _stream(client: httpx.AsyncClient, url: str, drop_after: int | None) -> int:
    """Stream a completion; drop the connection after ``drop_after`` chunks.

    Returns the chunks read when dropped, else the completion tokens the usage chunk counts.
    """
    body = {"prompt": "Once upon a time", "max_tokens": 100, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    return chunks  # leaving the block closes the connection
                if chunk.get("usage"):
                    return int(chunk["usage"]["completion_tokens"])
    raise AssertionError("the stream ended without its usage chunk")


def test_dropped_streams_free_their_blocks_and_the_rest_finish(server: Server) -> None:
    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = [_stream(client, server.url, 3 if i % 2 else None) for i in range(20)]
            return await asyncio.gather(*jobs)

    counts = asyncio.run(main())
    assert counts[1::2] == [3] * 10
    assert counts[0::2] == [100] * 10  # the kept streams got every token
    stats = {}
    for _ in range(100):
        stats = server.stats()
        if stats["kv_blocks_used"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0
    assert stats["num_requests_running"] == 0
    assert stats["kv_read_misses_total"] == 0 and stats["num_preemptions_total"] == 0


def test_sigterm_ends_streams_and_exits_0(ckpt: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with run_server(ckpt, *FLAGS, log_dir=tmp_path) as s:
        body = {"prompt": "x", "max_tokens": 110, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "text" in first
            s.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the stream was finished or aborted, not cut
        last = json.loads(rest[-2][6:])
        assert last["choices"][0]["finish_reason"] in ("length", "abort")
        assert s.process.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{s.url}/health", timeout=2)
