"""docker/nginx.conf in front of two ringserve processes (a real nginx on 127.0.0.1):
requests with an `X-Session-Id` header stick to one replica per session (prefix affinity),
requests without one spread over both, streams pass through unbuffered, and after one
replica is killed every request sent afterwards is answered by the other, once each, the
dead one's sessions included.

Which replica answered a request is read from the replicas' own
`ringserve:request_success_total` counters; requests whose replica is checked are sent one
at a time, so each one's count is attributable.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.deploy_utils import run_nginx
from tests.server_utils import Server, free_port, run_server
from tests.tiny_models import make_checkpoint

FLAGS = ("--block-size", "4", "--kv-cache-memory", "4MiB", "--max-model-len", "128",
         "--served-model-name", "tiny")
C = "/v1/completions"
SESSION = "X-Session-Id"

pytestmark = pytest.mark.slow

Cluster = tuple[str, list[Server]]


@contextmanager
def start_cluster(tmp: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two tiny-model servers and the shipped nginx over them: (nginx's URL, servers)."""
    ckpt = make_checkpoint("mistral", tmp.mktemp("ckpt"))
    logs = tmp.mktemp("log")
    with ExitStack() as stack:
        replicas = [stack.enter_context(run_server(ckpt, *FLAGS, log_dir=logs))
                    for _ in range(2)]
        upstreams = [r.url.removeprefix("http://") for r in replicas]
        yield stack.enter_context(run_nginx(upstreams, tmp.mktemp("nginx"))), replicas


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Shared by the tests that leave both replicas running."""
    with start_cluster(tmp_path_factory) as c:
        yield c


@pytest.fixture
def doomed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A pair of its own for the test that kills one, so the order of the tests is free."""
    with start_cluster(tmp_path_factory) as c:
        yield c


def served(server: Server) -> float:
    return server.stats()["request_success_total"]


def complete(url: str, i: int, stream: bool = False, session: str | None = None) -> int:
    body = {"prompt": f"request {i}", "max_tokens": 12, "stream": stream}
    headers = {SESSION: session} if session is not None else {}
    if not stream:
        return httpx.post(url + C, json=body, headers=headers, timeout=60).status_code
    with httpx.stream("POST", url + C, json=body, headers=headers, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) > 2, lines
        return r.status_code


def send(url: str, n: int, start: int = 0, sessions: list[str] | None = None) -> list[int]:
    """``n`` requests, four at a time, every third one streamed, the i-th with the session
    ``sessions[i % len]`` (none without ``sessions``); their statuses."""
    def one(i: int) -> int:
        session = sessions[i % len(sessions)] if sessions else None
        return complete(url, start + i, stream=i % 3 == 0, session=session)

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(n)))


def routes(url: str, replicas: list[Server], sessions: list[str], start: int = 0) -> list[int]:
    """One request per session, one at a time (every third one streamed): for each, the
    index of the replica that answered it."""
    out = []
    counts = [served(r) for r in replicas]
    for i, session in enumerate(sessions, start):
        assert complete(url, i, stream=i % 3 == 0, session=session) == 200
        now = [served(r) for r in replicas]
        gained = [n - c for n, c in zip(now, counts, strict=True)]
        assert sorted(gained) == [0, 1], gained  # answered once, by one replica
        out.append(gained.index(1))
        counts = now
    return out


def test_requests_spread_over_both_replicas(cluster: Cluster) -> None:
    url, replicas = cluster
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    before = [served(r) for r in replicas]
    assert send(url, 12) == [200] * 12
    gained = [served(r) - b for r, b in zip(replicas, before, strict=True)]
    assert sum(gained) == 12  # none lost, none run twice
    assert all(g > 0 for g in gained), gained


def test_one_session_stays_on_one_replica(cluster: Cluster) -> None:
    url, replicas = cluster
    before = [served(r) for r in replicas]
    homes = set(routes(url, replicas, ["conversation-1"] * 20))
    gained = [served(r) - b for r, b in zip(replicas, before, strict=True)]
    assert len(homes) == 1 and sorted(gained) == [0, 20], (homes, gained)


def test_sessions_spread_and_each_keeps_its_replica(cluster: Cluster) -> None:
    url, replicas = cluster
    keys = [f"session-{k}" for k in range(20)]
    before = [served(r) for r in replicas]
    home = dict(zip(keys, routes(url, replicas, keys), strict=True))
    gained = [served(r) - b for r, b in zip(replicas, before, strict=True)]
    assert sum(gained) == 20
    assert all(g > 0 for g in gained), home
    # Asked again, in another order, every session finds the replica it had.
    again = dict(zip(keys[::-1], routes(url, replicas, keys[::-1], 20), strict=True))
    assert again == home
    # Concurrent requests of the same sessions, streams among them, all answered once.
    before = [served(r) for r in replicas]
    assert send(url, 12, 200, sessions=keys) == [200] * 12
    assert sum(served(r) - b for r, b in zip(replicas, before, strict=True)) == 12


def test_a_killed_replica_loses_no_later_request(doomed_cluster: Cluster) -> None:
    """Its sessions move to the other replica; no request sent after the kill is lost, with
    a session or without, in either upstream pool."""
    url, replicas = doomed_cluster
    keys = [f"session-{k}" for k in range(12)]
    home = dict(zip(keys, routes(url, replicas, keys), strict=True))
    dead_index = home[keys[0]]
    dead, alive = replicas[dead_index], replicas[1 - dead_index]
    orphans = [k for k in keys if home[k] == dead_index]
    assert orphans and len(orphans) < len(keys), home  # both replicas had sessions
    dead.process.send_signal(signal.SIGKILL)
    dead.process.wait(10)
    before = served(alive)
    # One at a time first (sessions of the dead replica's: each finds it dead, or skips it
    # once marked failed), then concurrently, then without a session (the other pool).
    statuses = [complete(url, 100, session=orphans[0]),
                complete(url, 101, stream=True, session=orphans[-1]),
                complete(url, 102), complete(url, 103, stream=True)]
    statuses += [complete(url, 110 + i, stream=i % 2 == 0, session=k)
                 for i, k in enumerate(orphans)]
    statuses += send(url, 12, 130, sessions=keys)  # every session, concurrently
    statuses += send(url, 10, 150)
    assert statuses == [200] * len(statuses)
    assert served(alive) - before == len(statuses)


# -- one server name, several replicas (compose's `ringserve-replica`) --------------------

class _Echo(BaseHTTPRequestHandler):
    """Answers every request with the address it was received on."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = str(self.connection.getsockname()[0]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def echo_servers(hosts: list[str]) -> Iterator[int]:
    """An `_Echo` on each of ``hosts``, all on one port; yields the port."""
    for _ in range(20):
        port, servers = free_port(), []
        try:
            for host in hosts:
                servers.append(ThreadingHTTPServer((host, port), _Echo))
            break
        except OSError:  # the port is taken on another address: try another one
            for s in servers:
                s.server_close()
    else:
        pytest.fail(f"no port free on all of {hosts}")
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        yield port
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def name_namespace(hosts: Path) -> list[str]:
    """A command prefix that runs a command with ``hosts`` as /etc/hosts (in a mount
    namespace of its own), or skip where this system cannot: that takes root (in a user
    namespace nginx cannot switch its workers' user) and util-linux's unshare."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("needs root and util-linux unshare on Linux")
    prefix = [unshare, "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
              str(hosts)]
    probe = subprocess.run([*prefix, "getent", "ahostsv4", "replicas"], capture_output=True,
                           text=True)
    if probe.returncode != 0 or "127.0.0.2" not in probe.stdout:
        pytest.skip(f"cannot run in a mount namespace here: {probe.stderr.strip()}")
    return prefix


def test_sessions_stick_to_one_of_the_replicas_behind_one_name(tmp_path: Path) -> None:
    """In compose, `server ringserve-replica:8000` is every replica of that service: one
    name resolving to several addresses. `hash ... consistent` places the NAME on its
    ring and rotates among the addresses behind it (no affinity); plain `hash` must pick
    one address per session. Two echo servers on 127.0.0.1 and 127.0.0.2 play the
    replicas, `replicas` resolves to both."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.1 replicas\n127.0.0.2 replicas\n")
    prefix = name_namespace(hosts)
    with echo_servers(["127.0.0.1", "127.0.0.2"]) as port, \
            run_nginx([f"replicas:{port}"], tmp_path, wrap=prefix) as url, \
            httpx.Client(base_url=url, timeout=10) as client:
        answers = {f"session-{k}": [client.post(C, json={}, headers={SESSION: f"session-{k}"})
                                    for _ in range(6)] for k in range(12)}
        assert all(r.status_code == 200 for rs in answers.values() for r in rs)
        home = {k: {r.text for r in rs} for k, rs in answers.items()}
        assert all(len(h) == 1 for h in home.values()), home
        assert set().union(*home.values()) == {"127.0.0.1", "127.0.0.2"}, home
