"""The bounded drain of a real `ringserve serve` process on SIGTERM.

Running streams finish (or, past `--shutdown-timeout`, end with finish_reason "abort"), a
request sent during the drain is refused at connect or answered 503 with Retry-After, the
KV blocks all go back, and the process exits 0; a second SIGTERM exits at once.
"""

from __future__ import annotations

import json
import pathlib
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.server_utils import Server, run_server
from tests.tiny_models import make_checkpoint

# mistral: every layer slides (window 8), so eight long streams fit a small pool.
FLAGS = ("--block-size", "4", "--kv-cache-memory", "16MiB", "--max-model-len", "8192",
         "--max-num-seqs", "16", "--log-level", "info")
STREAMS = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("mistral", tmp_path_factory.mktemp("ckpt"))


@dataclass
class Stream:
    """One streamed completion read in a thread: its chunks' finish reasons and usage."""

    url: str
    max_tokens: int
    started: threading.Event = field(default_factory=threading.Event)
    tokens: int = 0
    finish: str | None = None
    done: bool = False
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        body = {"prompt": "drain me", "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body,
                              timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    for choice in chunk.get("choices", []):
                        self.finish = choice.get("finish_reason") or self.finish
                    if chunk.get("usage"):
                        self.tokens = chunk["usage"]["completion_tokens"]
                    self.started.set()
        except BaseException as err:  # reported by the test thread, in join()
            self.error = err
            self.started.set()

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream never ended"
        assert self.error is None, repr(self.error)


def open_streams(server: Server, max_tokens: int) -> list[Stream]:
    streams = [Stream(server.url, max_tokens).start() for _ in range(STREAMS)]
    for s in streams:
        assert s.started.wait(60), "a stream sent nothing"
    return streams


def refused_or_503(server: Server) -> str:
    """A new request during the drain: how it was turned away (it must be)."""
    body = {"prompt": "too late", "max_tokens": 2}
    try:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    except httpx.ConnectError:
        return "refused"
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] and r.json()["error"]["code"] == "server_not_ready"
    return "503"


def wait_exit(server: Server, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    code = server.process.wait(timeout)
    return code, time.monotonic() - start


def check_log(server: Server) -> str:
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "stopped: 0 KV blocks in use, 0 read misses" in log, log[-3000:]
    return log


def test_sigterm_lets_running_streams_finish(ckpt: pathlib.Path, tmp_path: pathlib.Path
                                            ) -> None:
    with run_server(ckpt, *FLAGS, "--shutdown-timeout", "120", log_dir=tmp_path) as s:
        streams = open_streams(s, max_tokens=600)
        s.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # uvicorn closes its listener within 0.1 s of the signal
        assert not any(st.done for st in streams), "the streams were too short to test"
        refused_or_503(s)
        for st in streams:
            st.join(120)
        assert [(st.finish, st.tokens, st.done) for st in streams] == \
            [("length", 600, True)] * STREAMS
        code, _ = wait_exit(s, 60)
        assert code == 0
        check_log(s)


def test_past_the_shutdown_timeout_the_rest_are_aborted(ckpt: pathlib.Path,
                                                        tmp_path: pathlib.Path) -> None:
    with run_server(ckpt, *FLAGS, "--shutdown-timeout", "1", log_dir=tmp_path) as s:
        streams = open_streams(s, max_tokens=8000)
        sent = time.monotonic()
        s.process.send_signal(signal.SIGTERM)
        for st in streams:
            st.join(30)
        ended = time.monotonic() - sent
        assert [(st.finish, st.done) for st in streams] == [("abort", True)] * STREAMS
        assert all(0 < st.tokens < 8000 for st in streams)
        code, _ = wait_exit(s, 30)
        assert code == 0
        assert 1 <= ended < 6, ended
        log = check_log(s)
        assert "drain timeout: aborting" in log


def test_a_second_sigterm_exits_at_once(ckpt: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with run_server(ckpt, *FLAGS, "--shutdown-timeout", "120", log_dir=tmp_path) as s:
        streams = open_streams(s, max_tokens=8000)
        s.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        s.process.send_signal(signal.SIGTERM)
        code, took = wait_exit(s, 30)
        assert code == 0 and took < 5, (code, took)
        for st in streams:
            assert st.thread is not None
            st.thread.join(10)
            assert st.finish != "length"  # none ran to its end: they were cut or aborted
        assert "second signal" in s.log.read_text()
