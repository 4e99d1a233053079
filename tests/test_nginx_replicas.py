"""docker/nginx.conf in front of two ringserve processes (a real nginx on 127.0.0.1):
requests spread over both, streams pass through unbuffered, and after one replica is killed
every request sent afterwards is answered by the other, once each.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from tests.deploy_utils import run_nginx
from tests.server_utils import Server, run_server
from tests.tiny_models import make_checkpoint

FLAGS = ("--block-size", "4", "--kv-cache-memory", "4MiB", "--max-model-len", "128",
         "--served-model-name", "tiny")
C = "/v1/completions"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Server]]]:
    ckpt = make_checkpoint("mistral", tmp_path_factory.mktemp("ckpt"))
    logs = tmp_path_factory.mktemp("log")
    with ExitStack() as stack:
        replicas = [stack.enter_context(run_server(ckpt, *FLAGS, log_dir=logs))
                    for _ in range(2)]
        upstreams = [r.url.removeprefix("http://") for r in replicas]
        url = stack.enter_context(run_nginx(upstreams, tmp_path_factory.mktemp("nginx")))
        yield url, replicas


def served(server: Server) -> float:
    return server.stats()["request_success_total"]


def complete(url: str, i: int, stream: bool = False) -> int:
    body = {"prompt": f"request {i}", "max_tokens": 12, "stream": stream}
    if not stream:
        return httpx.post(url + C, json=body, timeout=60).status_code
    with httpx.stream("POST", url + C, json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) > 2, lines
        return r.status_code


def send(url: str, n: int, start: int = 0) -> list[int]:
    """``n`` requests, four at a time, every third one streamed; their statuses."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda i: complete(url, i, stream=i % 3 == 0),
                             range(start, start + n)))


def test_requests_spread_over_both_replicas(cluster: tuple[str, list[Server]]) -> None:
    url, replicas = cluster
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    before = [served(r) for r in replicas]
    assert send(url, 12) == [200] * 12
    gained = [served(r) - b for r, b in zip(replicas, before, strict=True)]
    assert sum(gained) == 12  # none lost, none run twice
    assert all(g > 0 for g in gained), gained


def test_a_killed_replica_loses_no_later_request(cluster: tuple[str, list[Server]]) -> None:
    url, (dead, alive) = cluster
    dead.process.send_signal(signal.SIGKILL)
    dead.process.wait(10)
    before = served(alive)
    statuses = [complete(url, 100), complete(url, 101, stream=True), *send(url, 10, 102)]
    assert statuses == [200] * 12
    assert served(alive) - before == 12
