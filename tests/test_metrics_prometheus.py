"""/metrics through a real Prometheus: a live server with rings that wrap (window 6, block 4)
is scraped every second while requests run; every PromQL expression of the Grafana dashboard
then returns data, the ring counters are > 0 and read misses (checked with --debug-kv) are 0.
"""

from __future__ import annotations

import itertools
import pathlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.deploy_utils import (
    dashboard_targets,
    grafana_to_promql,
    has_data,
    query,
    run_prometheus,
    values,
)
from tests.server_utils import Server, run_server
from tests.tiny_models import make_checkpoint

FLAGS = ("--block-size", "4", "--kv-cache-memory", "4MiB", "--max-model-len", "256",
         "--max-num-batched-tokens", "64", "--debug-kv", "--served-model-name", "tiny")
C = "/v1/completions"
# Every series of docs/design.md §7, and the per-layer-group ones, as /metrics spells them.
DESIGN_SERIES = [
    "kv_cache_usage_perc", "kv_blocks_total", "kv_blocks_used", "kv_blocks_reserved",
    "num_requests_running", "num_requests_waiting", "max_concurrent_sequences",
    "ring_block_recycles_total", "ring_slot_overwrites_total", "kv_read_misses_total",
    "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
    "request_success_total", "requests_rejected_total",
    "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
    "kv_blocks_per_sequence_bucket",
    "kv_group_blocks_used", "kv_group_blocks_reserved",
    "kv_group_ring_blocks", "kv_block_size", "http_requests_rejected_total",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_blocks",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ckpt = make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"))
    with run_server(ckpt, *FLAGS, log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s


def test_metrics_has_every_design_series(server: Server) -> None:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in DESIGN_SERIES:
        assert f'\nringserve:{name}{{' in text, name
    for line in text.splitlines():
        if line.startswith("ringserve:"):
            assert 'model_name="tiny"' in line, line
    assert 'kv_group_blocks_used{group="sliding_6",model_name="tiny"}' in text
    assert 'kv_group_blocks_reserved{group="full",model_name="tiny"}' in text
    # R = ceil((6 + 3) / 4): prefix caching (on by default) gives each ring b - 1 slack
    assert 'kv_group_ring_blocks{group="sliding_6",model_name="tiny"} 3.0' in text
    # One pool for all groups; capacity for a short, a window-long and a max_model_len
    # request. The tiny gemma3 has 3 sliding layers (w=6: R=2 blocks of 4) and 1 full one,
    # each a group of its own.
    stats = server.stats()
    total = int(stats["kv_blocks_total"])
    assert total > 0
    for tokens in (6, 256):
        count = total // (3 * min(-(-tokens // 4), 3) + -(-tokens // 4))
        assert (f'max_concurrent_sequences{{model_name="tiny",tokens="{tokens}"}} '
                f'{float(count)}') in text


def traffic(url: str, stop: threading.Event, worker: int) -> None:
    """Requests long enough to wrap the rings, a stream now and then, and some errors."""
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in itertools.count():
            if stop.is_set():
                return
            body = {"prompt": f"The ring buffer {worker} {i}", "max_tokens": 24 + 8 * (i % 4)}
            if i % 3 == 2:
                with client.stream("POST", C, json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
            else:
                assert client.post(C, json=body).status_code == 200
            if i % 4 == 3:
                assert client.post(C, json={**body, "max_tokens": 0}).status_code == 400
                assert client.post(C, json={**body, "model": "nope"}).status_code == 404


def missing_under_traffic(url: str, prom: str, exprs: list[str],
                          timeout: float = 60) -> list[str]:
    """Run `traffic` from two workers against ``url`` until every PromQL expression returns
    data on ``prom`` (or ``timeout`` s pass); the expressions still without any. A worker's
    error is raised."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            traffic(url, stop, n)
        except BaseException as err:  # reported by the test thread
            errors.append(err)
            stop.set()

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    missing = list(exprs)
    try:
        deadline = time.monotonic() + timeout
        while missing and time.monotonic() < deadline and not errors:
            time.sleep(1)
            missing = [e for e in missing if not has_data(query(prom, e))]
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    return missing


@pytest.mark.slow
def test_prometheus_scrapes_every_dashboard_series(server: Server,
                                                   tmp_path: pathlib.Path) -> None:
    targets = dashboard_targets()
    assert len(targets) >= 20
    host = server.url.removeprefix("http://")
    with run_prometheus([host], tmp_path) as prom:
        exprs = {grafana_to_promql(t.expr): t for t in targets}
        missing = [exprs[e] for e in missing_under_traffic(server.url, prom, list(exprs))]
        assert not missing, "\n".join(f"{t.panel}: {t.expr}" for t in missing)
        assert values(query(prom, 'up{job="ringserve"}')) == [1.0]

        now = time.time()  # every total from one scrape

        def total(metric: str) -> float:
            return sum(values(query(prom, f'sum(ringserve:{metric}{{model_name="tiny"}})',
                                    at=now)))

        assert total("ring_block_recycles_total") > 0
        assert total("ring_slot_overwrites_total") > total("ring_block_recycles_total")
        assert total("kv_blocks_per_sequence_count") > 0
        assert total("http_requests_rejected_total") > 0
        assert total("kv_read_misses_total") == 0
        assert total("num_preemptions_total") == 0
    assert server.stats()["kv_read_misses_total"] == 0
