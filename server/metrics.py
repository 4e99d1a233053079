"""Prometheus metrics (docs/design.md §7), prefix ``ringserve:``, label ``model_name``.

Gauges and counters are the engine's own, as the engine thread last published them (one
snapshot a step, `EngineFront.stats`), read at scrape time (a collector): they never drift from
what the engine did and one scrape never mixes two moments; histograms are observed as
requests end.
Every layer group takes its blocks from one pool (``kv_blocks_total``). Per window (label
``group``, e.g. ``sliding_512`` and ``full`` for Gemma 3) the block gauges split the used and
reserved totals and ``kv_group_ring_blocks`` states each ring's length ``R``: a sliding
sequence never holds more than ``R`` blocks of each of that window's groups.
``max_concurrent_sequences`` is labelled ``tokens``: the sequences of that many tokens
(prompt + max_tokens) that fit at once, for a short request, one as long as each window and
one of ``max_model_len``.

Every labelled series is created at start-up (histograms empty, rejections at 0), so a
dashboard shows a flat 0 rather than "no data" before the first event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ringserve.block_manager import KVCacheSpec, admission
from ringserve.engine.async_llm import StreamDelta

P = "ringserve:"

GAUGES = {
    "kv_cache_usage_perc": "Fraction of KV blocks in use (0-1).",
    "kv_blocks_total": "Physical KV blocks in the pool every layer group shares.",
    "kv_blocks_used": "KV blocks held by running sequences.",
    "kv_blocks_reserved": "KV blocks reserved by admitted sequences (>= used).",
    "num_requests_running": "Sequences running.",
    "num_requests_waiting": "Sequences waiting for admission.",
    "weight_bytes": "Bytes the model's weights take in memory (quantized where quantized).",
    "decode_weight_bytes_per_token": "Weight bytes one decode step reads (its floor is "
    "this over the memory bandwidth).",
    "prefix_cache_blocks": "KV blocks findable by the prefix cache (in use or evictable).",
}
COUNTERS = {
    "ring_block_recycles": "KV blocks reused in place by a ring.",
    "ring_slot_overwrites": "KV slots overwritten by a newer position of the same ring.",
    "kv_read_misses": "Reads of a slot whose position was already overwritten (must stay 0).",
    "num_preemptions": "Sequences preempted (stays 0: admission is exact).",
    "prompt_tokens": "Prompt tokens computed.",
    "generation_tokens": "Tokens generated.",
    "requests_rejected": "Requests refused by the engine as invalid.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache (not computed again).",
    "prefix_cache_evictions": "Cached KV blocks evicted to make room.",
    "spec_decode_num_drafts": "Speculative decodes (steps that verified drafted tokens).",
    "spec_decode_num_draft_tokens": "Drafted tokens verified.",
    "spec_decode_num_accepted_tokens": "Drafted tokens kept.",
}
GROUP_GAUGES = {  # per window's layer groups: (KVStats field, help)
    "kv_group_blocks_used": ("blocks_used_per_group", "KV blocks of a layer group in use."),
    "kv_group_blocks_reserved": ("blocks_reserved_per_group",
                                 "KV blocks of a layer group reserved by admitted sequences."),
}
CAPACITY_DOC = ("Sequences of `tokens` tokens (prompt + max_tokens) the KV pool holds at once "
                "(capacity).")
ADMISSION_DOCS = (
    "Requests of this shape (no prefix hit) admitted now beside what runs and waits "
    "(--admission-shapes; GET /v1/admission answers any shape).",
    "Requests of this shape an idle server holds at once.",
    "1 if a request of this shape sent now is admitted at once (nothing waits, it fits).")
FINISH_REASONS = ("stop", "length", "abort")
# The statuses the server answers with (server/app.py ERRORS), counted from 0.
ERROR_STATUSES = ("400", "401", "404", "413", "429", "500", "503")
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, labels=["model_name", *labels])


# -- vLLM's names (``--metrics-compat vllm``) ------------------------------------------------

V = "vllm:"
VLLM_LABELS = ["model_name", "engine"]  # vLLM's v1 engine labels each series with its index
VLLM_GAUGES = {  # vLLM name: (our stats key, help)
    "num_requests_running": ("num_requests_running",
                             "Sequences running (vLLM counts requests; n > 1 counts n here)."),
    "num_requests_waiting": ("num_requests_waiting", "Sequences waiting for admission."),
    "kv_cache_usage_perc": ("kv_cache_usage_perc",
                            "Fraction of KV blocks in use (0-1); ringserve admits against "
                            "reservations (ringserve:kv_blocks_reserved), not this."),
}
VLLM_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens computed (cached ones not counted)."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "num_preemptions": ("num_preemptions", "Preemptions (always 0: admission is exact)."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the cache."),
}
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
VLLM_HISTOGRAMS = {  # name: (help, buckets)
    "time_to_first_token_seconds": ("Arrival to first token.", LATENCY_BUCKETS),
    "inter_token_latency_seconds": ("Time between tokens of a stream.", LATENCY_BUCKETS),
    "time_per_output_token_seconds": ("A request's mean time per token after its first.",
                                      LATENCY_BUCKETS),
    "e2e_request_latency_seconds": ("Arrival to last token.", LATENCY_BUCKETS),
    "request_queue_time_seconds": ("Arrival to admission.", LATENCY_BUCKETS),
    "request_prefill_time_seconds": ("Admission to first token.", LATENCY_BUCKETS),
    "request_decode_time_seconds": ("First token to last.", LATENCY_BUCKETS),
    "request_inference_time_seconds": ("Admission to last token.", LATENCY_BUCKETS),
    "request_prompt_tokens": ("Prompt tokens of a finished request.", TOKEN_BUCKETS),
    "request_generation_tokens": ("Tokens a finished request generated (all its sequences).",
                                  TOKEN_BUCKETS),
    "request_max_num_generation_tokens": ("The most tokens one sequence of a request "
                                          "generated.", TOKEN_BUCKETS),
    "request_params_max_tokens": ("A request's max_tokens.", TOKEN_BUCKETS),
}


class _EngineCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        stats = self.metrics.stats()
        label = [self.metrics.model_name]
        for name, doc in GAUGES.items():
            g = _gauge(name, doc, [])
            g.add_metric(label, float(stats.get(name, 0)))
            yield g
        for name, doc in COUNTERS.items():
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            c.add_metric(label, float(stats.get(name, 0)))
            yield c
        c = CounterMetricFamily(P + "request_success", "Requests finished, by finish reason.",
                                labels=["model_name", "finished_reason"])
        for reason in FINISH_REASONS:
            c.add_metric([*label, reason], float(stats.get(f"request_success_{reason}", 0)))
        yield c
        c = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                "Drafted tokens kept, by position in the draft (0 = first).",
                                labels=["model_name", "position"])
        for pos, count in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", [])):
            c.add_metric([*label, str(pos)], float(count))
        yield c
        g = _gauge("memory_plan_bytes", "The engine process's memory plan, decided at start "
                   "(docs/design.md §12), by part: weights, copies, kv, workspace, their "
                   "total, and the budget they were planned against.", ["part"])
        for part, value in stats.get("memory_plan_bytes", {}).items():
            g.add_metric([*label, part], float(value))
        yield g
        yield from self._groups(label, stats)
        yield from self._admission(label, stats)
        if self.metrics.compat == "vllm":
            yield from self._vllm(stats)

    def _vllm(self, stats: Mapping[str, Any]) -> Iterator[Any]:
        label = [self.metrics.model_name, "0"]
        for name, (key, doc) in VLLM_GAUGES.items():
            g = GaugeMetricFamily(V + name, doc, labels=VLLM_LABELS)
            g.add_metric(label, float(stats.get(key, 0)))
            yield g
        for name, (key, doc) in VLLM_COUNTERS.items():
            c = CounterMetricFamily(V + name, doc, labels=VLLM_LABELS)
            c.add_metric(label, float(stats.get(key, 0)))
            yield c
        c = CounterMetricFamily(V + "request_success", "Requests finished, by finish reason.",
                                labels=[*VLLM_LABELS, "finished_reason"])
        for reason in FINISH_REASONS:
            c.add_metric([*label, reason], float(stats.get(f"request_success_{reason}", 0)))
        yield c
        info = GaugeMetricFamily(V + "cache_config_info", "The KV cache's configuration.",
                                 labels=[*VLLM_LABELS, "block_size", "num_gpu_blocks",
                                         "enable_prefix_caching"])
        info.add_metric([*label, str(stats.get("kv_block_size", 0)),
                         str(stats.get("kv_blocks_total", 0)),
                         str(bool(stats.get("enable_prefix_caching", False)))], 1.0)
        yield info

    def _admission(self, label: list[str], stats: Mapping[str, Any]) -> Iterator[Any]:
        metrics = self.metrics
        state = stats.get("admission_state")
        if metrics.spec is None or state is None or not metrics.admission_shapes:
            return
        answers = [admission(metrics.spec, state, p, m) for p, m in metrics.admission_shapes]
        columns = {"admission_fit_now": [float(a.fit_now) for a in answers],
                   "admission_fit_empty": [float(a.fit_empty) for a in answers],
                   "admission_admit_now": [float(a.admit_now) for a in answers]}
        for (name, values), doc in zip(columns.items(), ADMISSION_DOCS, strict=True):
            g = _gauge(name, doc, ["prompt_tokens", "max_tokens"])
            for a, value in zip(answers, values, strict=True):
                g.add_metric([*label, str(a.prompt_tokens), str(a.max_tokens)], value)
            yield g

    def _groups(self, label: list[str], stats: Mapping[str, Any]) -> Iterator[GaugeMetricFamily]:
        if "kv_group_blocks_used" not in stats:
            return
        for name, (_field, doc) in GROUP_GAUGES.items():
            g = _gauge(name, doc, ["group"])
            for group, value in stats[name].items():
                g.add_metric([*label, group], float(value))
            yield g
        ring = _gauge("kv_group_ring_blocks", "Ring length R = ceil((window + slack) / "
                      "block_size): the most blocks a sequence holds in a sliding group.",
                      ["group"])
        for group, r in stats["kv_group_ring_blocks"].items():
            ring.add_metric([*label, group], float(r))
        yield ring
        fits = _gauge("max_concurrent_sequences", CAPACITY_DOC, ["tokens"])
        for tokens, count in stats["max_concurrent_sequences_by_tokens"].items():
            fits.add_metric([*label, str(tokens)], float(count))
        yield fits
        size = _gauge("kv_block_size", "Tokens per KV block.", [])
        size.add_metric(label, float(stats["kv_block_size"]))
        yield size


class Metrics:
    """The server's registry: engine series plus request histograms and HTTP rejections.

    Args:
        model_name: the served model name (label ``model_name`` of every series).
        stats: returns the engine's counters and gauges as one snapshot (`EngineFront.stats`:
            one scrape never mixes two moments, and never reads what the engine thread is
            changing).
    """

    def __init__(self, model_name: str, stats: Callable[[], Mapping[str, Any]],
                 spec: KVCacheSpec | None = None,
                 admission_shapes: Sequence[tuple[int, int]] = (),
                 compat: str | None = None) -> None:
        self.model_name = model_name
        self.stats = stats
        self.compat = compat  # "vllm": vLLM's series too (docs/metrics.md)
        self.spec = spec  # with admission_shapes: the admission gauges per shape
        self.admission_shapes = list(admission_shapes)
        self.registry = CollectorRegistry()
        self._last_token: dict[str, float] = {}
        self.registry.register(_EngineCollector(self))
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            h = Histogram(P + name, doc, labels, buckets=buckets, registry=self.registry)
            h.labels(model_name)  # exported (empty) from the start
            return h

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between tokens of a stream.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = hist("request_queue_time_seconds", "Arrival to admission.")
        self.blocks = hist("kv_blocks_per_sequence",
                           "KV blocks a sequence held at its end (all layer groups).",
                           BLOCK_BUCKETS)
        self.vllm: dict[str, Any] = {}
        if compat == "vllm":
            for name, (doc, buckets) in VLLM_HISTOGRAMS.items():
                h = Histogram(V + name, doc, VLLM_LABELS, buckets=buckets,
                              registry=self.registry)
                self.vllm[name] = h.labels(model_name, "0")
        self.http_rejected = Counter(P + "http_requests_rejected",
                                     "HTTP requests answered with an error, by status.",
                                     [*labels, "status"], registry=self.registry)
        for status in ERROR_STATUSES:
            self.http_rejected.labels(model_name, status)

    def on_delta(self, delta: StreamDelta) -> None:
        """Observe latencies as deltas leave the engine (called in its loop thread)."""
        t, m = delta.timings, self.model_name
        arrival, first, last = t.get("arrival"), t.get("first_token"), t.get("last_token")
        rid = delta.request_id
        new_tokens = any(s.token_ids for s in delta.seqs)
        v = self.vllm
        if new_tokens and last is not None:
            prev = self._last_token.get(rid)
            if prev is None and arrival is not None and first is not None:
                self.ttft.labels(m).observe(max(0.0, first - arrival))
                if v:
                    v["time_to_first_token_seconds"].observe(max(0.0, first - arrival))
            elif prev is not None and last > prev:
                self.itl.labels(m).observe(last - prev)
                if v:
                    v["inter_token_latency_seconds"].observe(last - prev)
            self._last_token[rid] = last
        if delta.finished:
            self._last_token.pop(rid, None)
            sched = t.get("scheduled")
            if arrival is not None and sched is not None:
                self.queue.labels(m).observe(max(0.0, sched - arrival))
            if arrival is not None and last is not None:
                self.e2e.labels(m).observe(max(0.0, last - arrival))
            for blocks in delta.blocks_held:
                self.blocks.labels(m).observe(blocks)
            if v:
                self._vllm_finished(delta, arrival, sched, first, last)

    def _vllm_finished(self, delta: StreamDelta, arrival: float | None, sched: float | None,
                       first: float | None, last: float | None) -> None:
        v = self.vllm
        spans = {"e2e_request_latency_seconds": (arrival, last),
                 "request_queue_time_seconds": (arrival, sched),
                 "request_prefill_time_seconds": (sched, first),
                 "request_decode_time_seconds": (first, last),
                 "request_inference_time_seconds": (sched, last)}
        for name, (start, end) in spans.items():
            if start is not None and end is not None:
                v[name].observe(max(0.0, end - start))
        if first is not None and last is not None and delta.max_seq_tokens > 1:
            v["time_per_output_token_seconds"].observe(
                max(0.0, last - first) / (delta.max_seq_tokens - 1))
        v["request_prompt_tokens"].observe(delta.prompt_tokens)
        v["request_generation_tokens"].observe(delta.completion_tokens)
        v["request_max_num_generation_tokens"].observe(delta.max_seq_tokens)
        v["request_params_max_tokens"].observe(delta.max_tokens)

    def rejected(self, status: int) -> None:
        self.http_rejected.labels(self.model_name, str(status)).inc()
