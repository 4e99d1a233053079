"""Prometheus metrics (DESIGN.md §7), prefix ``ringserve:``, label ``model_name``.

Gauges and counters are the engine's own, as the engine thread last published them (one
snapshot a step, `AsyncLLM.stats`), read at scrape time (a collector): they never drift from
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

from block_manager import KVCacheSpec, admission
from engine.async_llm import StreamDelta

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
        yield from self._groups(label, stats)
        yield from self._admission(label, stats)

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
        stats: returns the engine's counters and gauges as one snapshot (`AsyncLLM.stats`:
            one scrape never mixes two moments, and never reads what the engine thread is
            changing).
    """

    def __init__(self, model_name: str, stats: Callable[[], Mapping[str, Any]],
                 spec: KVCacheSpec | None = None,
                 admission_shapes: Sequence[tuple[int, int]] = ()) -> None:
        self.model_name = model_name
        self.stats = stats
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
        if new_tokens and last is not None:
            prev = self._last_token.get(rid)
            if prev is None and arrival is not None and first is not None:
                self.ttft.labels(m).observe(max(0.0, first - arrival))
            elif prev is not None and last > prev:
                self.itl.labels(m).observe(last - prev)
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

    def rejected(self, status: int) -> None:
        self.http_rejected.labels(self.model_name, str(status)).inc()
