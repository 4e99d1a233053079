"""The engine loop in a thread beside an asyncio server: per-request streams and aborts
(the thread contract: docs/design.md §11).

The loop thread alone touches engine state. Requests are tokenized and checked on the
caller's side (`LLMEngine.make_request` reads nothing that changes), then handed over
through a queue; each step's changes go back to each request's asyncio queue as deltas.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ringserve.engine.errors import EngineDeadError, InvalidRequestError
from ringserve.engine.llm_engine import LLMEngine, Prompt
from ringserve.engine.outputs import Request
from ringserve.engine.sampling_params import SamplingParams
from ringserve.engine.sequence import PromptLogprob, TokenLogprob
from ringserve.engine.stopping import stream_text

logger = logging.getLogger("ringserve.engine")


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


def _delta(request: Request) -> StreamDelta:
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


class AsyncLLM:
    """Runs an `LLMEngine` in a background thread; `generate` streams deltas.

    Args:
        engine: the engine to drive; owned by the loop thread from `start` on.
        max_waiting: refuse new requests while this many sequences wait (None = no cap).
        on_delta: called in the loop thread with every delta (metrics).
    """

    def __init__(self, engine: LLMEngine, *, max_waiting: int | None = None,
                 on_delta: Callable[[StreamDelta], None] | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_delta = on_delta
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.dead: BaseException | None = None
        self.accepting = True
        self._aborting = False  # abort_all() ran: what arrives later is aborted on arrival
        # Stats as the loop thread last published them (`stats`): other threads never read
        # the engine's live dicts, which the loop changes as they would be read.
        self._snapshot: Mapping[str, Any] = MappingProxyType(engine.stats())
        self._rejected_early = 0  # requests refused by `prepare`, in the callers' thread
        self._inbox_seqs = 0  # sequences queued but not yet taken in by the loop
        self._inbox_lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ringserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: running requests are aborted and their streams closed."""
        self.accepting = False
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def prepare(self, prompt: Prompt, params: SamplingParams,
                request_id: str | None = None) -> Request:
        """Tokenize and check a request now, in the caller's thread; queue nothing yet.

        Raises:
            InvalidRequestError: bad input, naming the parameter.
            QueueFullError: ``max_waiting`` sequences are already waiting.
            EngineDeadError: the loop is gone or shutting down.
        """
        if self.dead is not None or not self.accepting:
            raise EngineDeadError("the engine is not accepting requests")
        request_id = request_id or f"req-{next(self._ids)}"
        try:
            request = self.engine.make_request(request_id, prompt, params)
        except InvalidRequestError:
            self._rejected_early += 1  # NOTE: not the engine's counters: the loop owns them
            raise
        self.check_room([request])
        return request

    def check_room(self, requests: list[Request]) -> None:
        """Refuse requests whose sequences (``n`` each) would take the waiting queue past
        ``max_waiting`` sequences (one HTTP request may bring many prompts).

        Raises:
            InvalidRequestError: more sequences than may ever wait, naming ``n``.
            QueueFullError: not now.
        """
        if self.max_waiting is None:
            return
        new = sum(len(r.seqs) for r in requests)
        if new > self.max_waiting:
            self._rejected_early += 1
            raise InvalidRequestError(
                f"this request brings {new} sequences (prompts x n); at most "
                f"{self.max_waiting} may wait (--max-waiting)", param="n")
        if self.num_waiting + new > self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.num_waiting} of "
                                 f"{self.max_waiting} sequences; this request brings {new})")

    async def stream(self, request: Request) -> AsyncIterator[StreamDelta]:
        """Queue a prepared request and yield its deltas until it finishes.

        Raises:
            EngineDeadError: the loop is gone.
            Exception: an engine error that hit this request's step.
        """
        request_id = request.request_id
        stream: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        with self._inbox_lock:
            self._inbox_seqs += len(request.seqs)
        self._inbox.put(("add", request))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer left early (client disconnect): free it now
                self.abort(request_id)

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """`prepare` then `stream`: submit a request and yield its deltas."""
        request = self.prepare(prompt, params, request_id)
        async for delta in self.stream(request):
            yield delta

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks return to the pool on the loop's next turn."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def abort_all(self) -> None:
        """Refuse new requests and abort every one queued or running (the end of a drain):
        each stream gets its final delta, finish_reason "abort"; the blocks go back."""
        self.accepting = False
        self._inbox.put(("abort_all", None))
        self._wake.set()

    def stats(self) -> Mapping[str, Any]:
        """The engine's counters and gauges as of its last step (`LLMEngine.stats`), one
        consistent snapshot: safe from any thread."""
        snap = self._snapshot
        if not self._rejected_early:
            return snap
        return MappingProxyType({**snap, "requests_rejected":
                                 snap["requests_rejected"] + self._rejected_early})

    def _publish_stats(self) -> None:
        self._snapshot = MappingProxyType(self.engine.stats())

    @property
    def num_running(self) -> int:
        """Requests the engine holds (waiting or running) plus those not yet taken in."""
        return len(self.engine.requests) + self._inbox.qsize()

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission, those not yet taken in included."""
        return len(self.engine.scheduler.waiting) + self._inbox_seqs

    # -- the loop thread ---------------------------------------------------------------

    def _loop(self) -> None:
        self.engine.owner_thread = threading.get_ident()
        try:
            self._steps()
        finally:
            self.engine.owner_thread = None

    def _steps(self) -> None:
        try:
            while not self._stop.is_set():
                if self._drain_inbox():
                    self._publish_stats()
                if not self.engine.has_unfinished:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                finished = self.engine.step()
                self._publish_stats()  # before the deltas: a stream's end sees its blocks back
                for request in finished:
                    self._publish(request)
        except BaseException as err:  # the loop itself broke: fail every stream
            logger.exception("engine loop died")
            self.dead = err
            self._fail_all(EngineDeadError(f"engine loop died: {err!r}"))
            return
        self._drain_inbox()
        for request_id in list(self.engine.requests):
            self._publish_abort(request_id)
        self._publish_stats()
        self._fail_all(EngineDeadError("the engine shut down"))

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
                with self._inbox_lock:
                    self._inbox_seqs -= len(payload.seqs)
                try:
                    self.engine.add(payload)
                except InvalidRequestError as err:
                    self._send(payload.request_id, err)
                    continue
                if self._aborting:
                    self._publish_abort(payload.request_id)
            elif kind == "abort_all":
                self._aborting = True
                for request_id in list(self.engine.requests):
                    self._publish_abort(request_id)
            else:
                self._publish_abort(payload)

    def _publish_abort(self, request_id: str) -> None:
        request = self.engine.abort_request(request_id)
        if request is not None:
            self._publish_stats()  # its blocks are back before its stream ends
            self._publish(request)

    def _publish(self, request: Request) -> None:
        if request.error is not None:
            self._send(request.request_id, request.error)
        else:
            delta = _delta(request)
            if self.on_delta is not None:
                self.on_delta(delta)
            self._send(request.request_id, delta)

    def _send(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _fail_all(self, err: BaseException) -> None:
        for request_id in list(self._streams):
            self._send(request_id, err)


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the server answers 429."""
