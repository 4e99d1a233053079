"""The deployment files check out without a Docker engine: compose (each profile and the GPU
override) validates, the Dockerfiles lint clean, Prometheus' and nginx's configs load, the
dashboard's PromQL parses and refers only to series the server exports, and the images
install what the rest of the project pins.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ringserve.server import metrics
from ringserve.server.cli import ABORT_GRACE_S, defaults
from tests.deploy_utils import (
    DASHBOARD,
    DOCKER,
    ROOT,
    dashboard,
    dashboard_targets,
    grafana_to_promql,
    nginx_cmd,
    nginx_conf,
    panels,
    tool,
)

COMPOSE = DOCKER / "docker-compose.yml"
GPU = DOCKER / "docker-compose.gpu.yml"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda"]


def run(*cmd: str | Path, cwd: Path = ROOT) -> str:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}:\n{out.stdout}{out.stderr}"
    return out.stdout


def compose(*args: str, files: tuple[Path, ...] = (COMPOSE,)) -> str:
    flags = [x for f in files for x in ("-f", str(f))]
    return run(tool("docker-compose"), *flags, *args)


@pytest.mark.parametrize("profile", [None, "scale"])
@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_compose_validates(profile: str | None, gpu: bool) -> None:
    files = (COMPOSE, GPU) if gpu else (COMPOSE,)
    prof = ("--profile", profile) if profile else ()
    compose(*prof, "config", "-q", files=files)


def test_compose_stop_grace_covers_the_drain() -> None:
    """docker stop's SIGKILL must come after the server's drain and its aborts' last chunks
    (the compose command leaves --shutdown-timeout at its default)."""
    config: dict[str, Any] = yaml.safe_load(compose("--profile", "scale", "config"))
    shutdown = float(defaults()["shutdown_timeout"])
    for name in ("ringserve", "ringserve-replica"):
        service = config["services"][name]
        assert "--shutdown-timeout" not in service["command"]
        grace = re.fullmatch(r"(\d+)s", str(service["stop_grace_period"]))
        assert grace is not None and int(grace[1]) > shutdown + ABORT_GRACE_S


def test_compose_profiles_and_mounts() -> None:
    config: dict[str, Any] = yaml.safe_load(compose("--profile", "scale", "config"))
    services = config["services"]
    profiles = {name: s.get("profiles", []) for name, s in services.items()}
    assert profiles == {"ringserve": [], "prometheus": [], "grafana": [],
                        "ringserve-replica": ["scale"], "nginx": ["scale"]}
    assert services["ringserve-replica"]["deploy"]["replicas"] >= 2
    for name in ("ringserve", "ringserve-replica"):
        s = services[name]
        assert s["build"]["dockerfile"] == "docker/Dockerfile"
        assert Path(s["build"]["context"]) == ROOT
        assert ("model-cache", "/cache") in mounts(s)
    for s in services.values():  # every bind mount names a file of this repository
        for source, _ in mounts(s):
            if source.startswith("/"):
                assert Path(source).exists(), source
    gpu = yaml.safe_load(compose("--profile", "scale", "config", files=(COMPOSE, GPU)))
    for name in ("ringserve", "ringserve-replica"):
        s = gpu["services"][name]
        assert s["build"]["dockerfile"] == "docker/Dockerfile.cuda"
        assert s["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of a service's volumes, in compose's short or long form."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
            out.append((source, target))
        else:
            out.append((v["source"], v["target"]))
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    run(tool("hadolint"), dockerfile)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_pin_what_the_project_pins(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    pins = dict(re.findall(r"^(torch|triton)==(\S+)$",
                           (ROOT / "requirements" / "torch-cpu.txt").read_text(), re.M))
    assert f"ARG TORCH_VERSION={pins['torch']}" in text
    if "TRITON_VERSION" in text:
        assert f"ARG TRITON_VERSION={pins['triton']}" in text
    presets = yaml.safe_load((ROOT / "configs" / "models.yaml").read_text())["presets"]
    for preset in presets.values():
        assert f" {preset['package']}==" in text, preset["package"]
    for line in ("USER 10001:10001", 'VOLUME ["/cache"]', "RINGSERVE_CACHE=/cache",
                 "HEALTHCHECK", "/health", 'CMD ["serve", "--host", "0.0.0.0"'):
        assert line in text, line


def test_promtool_checks_prometheus_yml() -> None:
    run(tool("promtool"), "check", "config", DOCKER / "prometheus.yml")
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "ringserve")
    assert job["static_configs"][0]["targets"] == ["ringserve:8000"]
    assert job["dns_sd_configs"][0]["names"] == ["ringserve-replica"]


def test_nginx_conf_loads(tmp_path: Path) -> None:
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_conf(["127.0.0.1:1", "127.0.0.1:2"], 8080))
    run(*nginx_cmd(conf, tmp_path, "-t"))
    text = (DOCKER / "nginx.conf").read_text()
    for directive in ("least_conn;", "proxy_buffering off;", "proxy_next_upstream error"):
        assert directive in text


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """promtool parses every expression (as recording rules), Grafana variables replaced."""
    targets = dashboard_targets()
    rules = [{"record": f"dashboard:expr_{i}", "expr": grafana_to_promql(t.expr)}
             for i, t in enumerate(targets)]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run(tool("promtool"), "check", "rules", path)


def exported_series() -> set[str]:
    names = {*metrics.GAUGES, *metrics.GROUP_GAUGES, "kv_group_ring_blocks", "kv_block_size",
             "max_concurrent_sequences"}
    names |= {f"{c}_total" for c in (*metrics.COUNTERS, "request_success",
                                     "http_requests_rejected")}
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds",
              "kv_blocks_per_sequence"):
        names |= {f"{h}_bucket", f"{h}_sum", f"{h}_count"}
    return names


def test_dashboard_refers_to_exported_series_only() -> None:
    exported = exported_series()
    used: set[str] = set()
    for t in dashboard_targets():
        names = set(re.findall(r"ringserve:([a-z0-9_]+)", t.expr))
        assert names, t
        assert names <= exported, (t.panel, names - exported)
        used |= names
    # The panels: KV usage and reservations, ring recycles and overwrites, read
    # misses, blocks per sequence, running/waiting, TTFT and ITL, tokens/s, rejections.
    wanted = {"kv_cache_usage_perc", "kv_blocks_used", "kv_blocks_reserved", "kv_blocks_total",
              "kv_group_blocks_used", "ring_block_recycles_total", "ring_slot_overwrites_total",
              "kv_read_misses_total", "kv_blocks_per_sequence_bucket", "num_requests_running",
              "num_requests_waiting", "max_concurrent_sequences",
              "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
              "generation_tokens_total", "http_requests_rejected_total"}
    assert wanted <= used, wanted - used


def test_dashboard_is_provisioned_against_the_provisioned_datasource() -> None:
    prov = DOCKER / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    uid = ds[0]["uid"]
    assert ds[0]["url"] == "http://prometheus:9090"
    dash = dashboard()
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        assert set(p["gridPos"]) == {"h", "w", "x", "y"}
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == uid, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["description"], p["title"]
    for var in dash["templating"]["list"]:
        assert var["datasource"]["uid"] == uid
    provider = yaml.safe_load((prov / "dashboards" / "ringserve.yml").read_text())
    mounted = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]["volumes"]
    path = provider["providers"][0]["options"]["path"]
    assert f"./grafana/dashboards:{path}:ro" in mounted
    assert DASHBOARD.parent.name == "dashboards"
