"""``--metrics-compat vllm``: vLLM's metric names, read by real Prometheus (issue 26).

The queries are the ones vLLM's own Grafana dashboard (examples/observability/
prometheus_grafana/grafana.json in its repository) and the gateways that route to vLLM
(llm-d's endpoint picker, the Gateway API Inference Extension: queue, running and KV usage
gauges) run, written out here with the dashboard's model_name filter and a 15 s rate window.
Each must return data against ringserve under traffic.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.deploy_utils import query, run_prometheus, values
from tests.server_utils import Server, run_server
from tests.test_metrics_prometheus import missing_under_traffic
from tests.tiny_models import make_checkpoint

M = '{model_name="tiny"}'
HISTOGRAMS = ["e2e_request_latency_seconds", "inter_token_latency_seconds",
              "time_to_first_token_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "request_max_num_generation_tokens",
              "request_params_max_tokens", "time_per_output_token_seconds"]
QUERIES = [
    *(f"histogram_quantile(0.99, sum by(le) (rate(vllm:{h}_bucket{M}[15s])))"
      for h in HISTOGRAMS[:3]),
    *(f"rate(vllm:{h}_sum{M}[15s]) / rate(vllm:{h}_count{M}[15s])" for h in HISTOGRAMS[:3]),
    f"rate(vllm:prompt_tokens_total{M}[15s])",
    f"rate(vllm:generation_tokens_total{M}[15s])",
    f"vllm:num_requests_running{M}",
    f"vllm:num_requests_waiting{M}",
    f"vllm:kv_cache_usage_perc{M}",
    f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{M}[15s]))",
    f"sum by(le) (increase(vllm:request_generation_tokens_bucket{M}[15s]))",
    f"sum by(finished_reason) (increase(vllm:request_success_total{M}[15s]))",
    *(f"rate(vllm:{h}_sum{M}[15s])" for h in HISTOGRAMS[3:]),
    f"vllm:num_preemptions_total{M}",
    f"rate(vllm:prefix_cache_queries_total{M}[15s])",
    f"vllm:prefix_cache_hits_total{M}",
    f"vllm:cache_config_info{M}",
]
FLAGS = ("--block-size", "4", "--kv-cache-memory", "4MiB", "--max-model-len", "256",
         "--max-num-batched-tokens", "64", "--served-model-name", "tiny",
         "--metrics-compat", "vllm")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ckpt = make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"))
    with run_server(ckpt, *FLAGS, log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s


def test_vllm_series_beside_ours(server: Server) -> None:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("vllm:num_requests_running{", "vllm:kv_cache_usage_perc{",
                 "vllm:prompt_tokens_total{", "vllm:time_to_first_token_seconds_bucket{",
                 "ringserve:kv_blocks_total{"):
        assert "\n" + name in text, name
    for line in text.splitlines():
        if line.startswith("vllm:"):
            assert 'model_name="tiny"' in line and 'engine="0"' in line, line
    info = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    assert 'block_size="4"' in info and 'enable_prefix_caching="True"' in info


def test_without_the_flag_there_are_none(tmp_path: pathlib.Path) -> None:
    ckpt = make_checkpoint("llama", tmp_path)
    with run_server(ckpt, "--block-size", "4", "--kv-cache-memory", "1MiB", "--max-model-len",
                    "64", log_dir=tmp_path) as s:
        assert "vllm:" not in httpx.get(s.url + "/metrics", timeout=10).text


def test_prometheus_answers_vllms_dashboard_queries(server: Server,
                                                     tmp_path: pathlib.Path) -> None:
    with run_prometheus([server.url.removeprefix("http://")], tmp_path) as prom:
        missing = missing_under_traffic(server.url, prom, QUERIES)
        assert not missing, "\n".join(missing)
        # the same numbers under both names, in one scrape (read at one time: traffic ran
        # until just now, and a scrape between two queries once made them differ)
        now = time.time()
        ours = values(query(prom, f"ringserve:generation_tokens_total{M}", at=now))
        theirs = values(query(prom, f"vllm:generation_tokens_total{M}", at=now))
        assert ours == theirs and ours[0] > 0
