"""Start a real `ringserve serve` process on 127.0.0.1 for tests, and stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def stats(self) -> dict[str, float]:
        """The ringserve:* samples of /metrics, by name (label sets summed)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("ringserve:"):
                name = line.split("{")[0].split(" ")[0].removeprefix("ringserve:")
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


@contextmanager
def run_server(model: str | Path, *args: str, log_dir: Path, timeout: float = 600,
               env: dict[str, str] | None = None) -> Iterator[Server]:
    """A server process for ``model``; waits until /health says ready."""
    port = free_port()
    log = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "ringserve.server.cli", "serve", "--model", str(model),
           "--port", str(port), "--log-level", "warning", *args]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_ready(server, timeout)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:  # a server whose engine failed exits: why
            text = server.log.read_text()
            why = [line.split("exiting in", 1)[1] for line in text.splitlines()
                   if "exiting in" in line]
            head = f"server failed to start: {why[-1]}" if why else "server exited"
            raise RuntimeError(f"{head}\n{text[-3000:]}")
        try:
            health = httpx.get(f"{server.url}/health", timeout=2)
            if health.status_code == 200:
                return
            if health.json().get("status") == "failed":  # the engine did not start: say why
                raise RuntimeError(f"server failed to start: {health.json().get('error')}\n"
                                   f"{server.log.read_text()[-3000:]}")
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"server not ready after {timeout} s: {server.log.read_text()[-3000:]}")
