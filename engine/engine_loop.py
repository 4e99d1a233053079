"""The engine's step loop: commands in, steps, each request's news out (docs/design.md §11).

One thread runs `EngineLoop.run` and alone touches the engine: in the API process beside
the server (`AsyncLLM`, the in-process mode) or as the engine core process's main thread
(`engine.core_proc`). Commands arrive through `put` from any thread; what a step changed
goes to a `Sink` as one `StreamDelta` per request (or the error that ended it), and the
engine's stats go out as one snapshot after every step, before the deltas that step made,
so a stream's last delta never arrives before the snapshot in which its blocks are back.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from ringserve.engine.llm_engine import LLMEngine
from ringserve.engine.outputs import Request
from ringserve.engine.request_check import CheckedRequest
from ringserve.engine.sequence import PromptLogprob, TokenLogprob
from ringserve.engine.stopping import stream_text


@dataclass
class SeqDelta:
    """What one continuation gained in a step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class StreamDelta:
    """One step's news for one request; the last one has ``finished`` set."""

    request_id: str
    seqs: list[SeqDelta]
    finished: bool
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float | None] = field(default_factory=dict)
    blocks_held: list[int] = field(default_factory=list)  # per sequence, once finished
    max_tokens: int = 0  # the request's max_tokens, resolved (for vLLM's histograms)
    max_seq_tokens: int = 0  # the most tokens one of its sequences generated, once finished
    # the request's prompt logprobs, in the one delta after they are all computed (it comes
    # no later than the first sequence's first token)
    prompt_logprobs: list[PromptLogprob | None] | None = None


def delta_of(request: Request) -> StreamDelta:
    """What ``request`` gained since its last delta (and mark it sent)."""
    seqs = []
    for s in request.seqs:
        done = s.status.is_finished
        new_ids = s.output_token_ids[s.sent_tokens :]
        s.sent_tokens += len(new_ids)
        new_lps = s.logprobs[s.sent_logprobs :]
        s.sent_logprobs += len(new_lps)
        seqs.append(SeqDelta(s.index, stream_text(s), new_ids, new_lps,
                             s.status.finish_reason if done else None,
                             s.stop_reason if done else None))
    first = request.seqs[0]
    prompt_logprobs = None
    if not request.prompt_logprobs_sent and request.prompt_logprob_records is not None:
        prompt_logprobs = request.prompt_logprob_records
        request.prompt_logprobs_sent = True
    return StreamDelta(
        request_id=request.request_id, seqs=seqs, finished=request.finished,
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=sum(s.num_output_tokens for s in request.seqs),
        timings={"arrival": first.arrival_time, "scheduled": first.first_scheduled_time,
                 "first_token": first.first_token_time, "last_token": first.last_token_time},
        blocks_held=[s.blocks_held for s in request.seqs] if request.finished else [],
        prompt_logprobs=prompt_logprobs,
        max_tokens=first.max_tokens,
        max_seq_tokens=max(s.num_output_tokens for s in request.seqs) if request.finished else 0,
    )


class Sink(Protocol):
    """Where a loop's output goes."""

    def send(self, request_id: str, item: StreamDelta | BaseException) -> None:
        """A request's delta, or the error that ended it."""

    def publish(self, stats: dict[str, Any]) -> None:
        """The engine's stats as of now (a fresh dict, never changed after)."""

    def flush(self) -> None:
        """The end of a turn of the loop: what was sent may go out together."""


class EngineLoop:
    """Steps ``engine`` until `stop`; commands come through `put` from any thread:
    ``("add", CheckedRequest)``, ``("abort", request_id)``, ``("abort_all", None)``."""

    def __init__(self, engine: LLMEngine, sink: Sink) -> None:
        self.engine, self.sink = engine, sink
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._aborting = False  # abort_all ran: what arrives later is aborted on arrival
        self.taken_in = 0  # sequences taken in so far (the fronts count what is in transit)

    def put(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def stop(self) -> None:
        """End `run` after its current step: running requests are aborted."""
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Step until stopped, then abort what is left. An exception that escapes is one
        the loop could not keep to a request; the caller fails every stream with it."""
        engine = self.engine
        engine.owner_thread = threading.get_ident()
        try:
            self._publish_stats()
            while not self._stop.is_set():
                if self._drain_inbox():
                    self._publish_stats()
                if not engine.has_unfinished:
                    self.sink.flush()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                finished = engine.step()
                self._publish_stats()  # before the deltas: a stream's end sees its blocks back
                for request in finished:
                    self._publish(request)
                self.sink.flush()
            self._drain_inbox()
            for request_id in list(engine.requests):
                self._publish_abort(request_id)
            self._publish_stats()
            self.sink.flush()
        finally:
            engine.owner_thread = None

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        stats["sequences_taken_in"] = self.taken_in
        self.sink.publish(stats)

    def _drain_inbox(self) -> bool:
        """Take in what callers queued; whether there was anything."""
        took = False
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return took
            took = True
            if kind == "add":
                self._add(payload)
            elif kind == "abort_all":
                self._aborting = True
                for request_id in list(self.engine.requests):
                    self._publish_abort(request_id)
            else:
                self._publish_abort(payload)

    def _add(self, checked: CheckedRequest) -> None:
        self.taken_in += checked.num_seqs
        try:
            self.engine.add(self.engine.build(checked))
        except Exception as err:  # its request id in use, or its constraint unreadable
            self.sink.send(checked.request_id, err)
            return
        if self._aborting:
            self._publish_abort(checked.request_id)

    def _publish_abort(self, request_id: str) -> None:
        request = self.engine.abort_request(request_id)
        if request is not None:
            self._publish_stats()  # its blocks are back before its stream ends
            self._publish(request)

    def _publish(self, request: Request) -> None:
        if request.error is not None:
            self.sink.send(request.request_id, request.error)
        else:
            self.sink.send(request.request_id, delta_of(request))
