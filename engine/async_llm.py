"""Engine fronts for an asyncio server: per-request streams, aborts, stats snapshots
(docs/design.md §11).

A front checks and tokenizes requests on the caller's side (`RequestChecker`: it reads only
facts fixed at start-up), hands them to the engine loop, and routes each step's deltas to
each request's asyncio queue. Two fronts share this class's stream handling:

- `AsyncLLM`: the loop in a thread of this process (tests, and ``--engine-core thread``);
- `engine.core_client.CoreClient`: the loop in the engine core process (the server's
  default), reached over pipes.

Nothing here reads live engine state: stats, waiting counts and admission come from the
snapshot the loop published last.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from types import MappingProxyType
from typing import Any

from ringserve.engine.engine_loop import EngineLoop, SeqDelta, StreamDelta
from ringserve.engine.errors import EngineDeadError, InvalidRequestError
from ringserve.engine.llm_engine import LLMEngine
from ringserve.engine.request_check import CheckedRequest, Prompt, RequestChecker, RequestLimits
from ringserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("ringserve.engine")

__all__ = ["AsyncLLM", "EngineFront", "QueueFullError", "SeqDelta", "StreamDelta"]


class EngineFront:
    """Streams, aborts and admission control over an engine loop somewhere else.

    Subclasses set `checker`, `tokenizer`, `model_name` and the first `_snapshot`, and
    deliver commands (`_command`); their loop's output comes back through `_deliver` and
    `_set_snapshot`, from any thread.

    Args:
        max_waiting: refuse new requests while this many sequences wait (None = no cap).
        on_delta: called with every delta as it arrives (metrics), in the delivering thread.
    """

    checker: RequestChecker
    tokenizer: Any
    model_name: str

    def __init__(self, *, max_waiting: int | None = None,
                 on_delta: Callable[[StreamDelta], None] | None = None) -> None:
        self.max_waiting = max_waiting
        self.on_delta = on_delta
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._ids = itertools.count()
        self.dead: BaseException | None = None
        self.accepting = True
        self._snapshot: Mapping[str, Any] = MappingProxyType({})
        self._rejected_early = 0  # requests refused by `prepare`, on the callers' side
        self._sent_seqs = 0  # sequences handed to the loop (it counts those it took in)
        self._sent_lock = threading.Lock()

    @property
    def limits(self) -> RequestLimits:
        return self.checker.limits

    # -- the caller's side -------------------------------------------------------------

    def prepare(self, prompt: Prompt, params: SamplingParams,
                request_id: str | None = None) -> CheckedRequest:
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
            request = self.checker.check(request_id, prompt, params)
        except InvalidRequestError:
            self._rejected_early += 1  # NOTE: not the engine's counters: the loop owns them
            raise
        self.check_room([request])
        return request

    def check_room(self, requests: list[CheckedRequest]) -> None:
        """Refuse requests whose sequences (``n`` each) would take the waiting queue past
        ``max_waiting`` sequences (one HTTP request may bring many prompts).

        Raises:
            InvalidRequestError: more sequences than may ever wait, naming ``n``.
            QueueFullError: not now.
        """
        if self.max_waiting is None:
            return
        new = sum(r.num_seqs for r in requests)
        if new > self.max_waiting:
            self._rejected_early += 1
            raise InvalidRequestError(
                f"this request brings {new} sequences (prompts x n); at most "
                f"{self.max_waiting} may wait (--max-waiting)", param="n")
        if self.num_waiting + new > self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.num_waiting} of "
                                 f"{self.max_waiting} sequences; this request brings {new})")

    async def stream(self, request: CheckedRequest) -> AsyncGenerator[StreamDelta, None]:
        """Queue a prepared request and yield its deltas until it finishes.

        Raises:
            EngineDeadError: the loop is gone.
            Exception: an engine error that hit this request's step.
        """
        if self.dead is not None:
            raise EngineDeadError(f"the engine is gone: {self.dead}")
        request_id = request.request_id
        stream: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        with self._sent_lock:
            self._sent_seqs += request.num_seqs
        finished = False
        try:
            self._command("add", request)
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
            if not finished and self.dead is None:  # the consumer left early: free it now
                self.abort(request_id)

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """`prepare` then `stream`: submit a request and yield its deltas."""
        request = self.prepare(prompt, params, request_id)
        async for delta in self.stream(request):
            yield delta

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks return to the pool on the loop's next turn."""
        self._command("abort", request_id)

    def abort_all(self) -> None:
        """Refuse new requests and abort every one queued or running (the end of a drain):
        each stream gets its final delta, finish_reason "abort"; the blocks go back."""
        self.accepting = False
        self._command("abort_all", None)

    def stats(self) -> Mapping[str, Any]:
        """The engine's counters and gauges as of its last step (`LLMEngine.stats`), one
        consistent snapshot: safe from any thread."""
        snap = self._snapshot
        if not self._rejected_early:
            return snap
        return MappingProxyType({**snap, "requests_rejected":
                                 snap["requests_rejected"] + self._rejected_early})

    @property
    def num_running(self) -> int:
        """Requests in flight: streams open on this front."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission, those on their way to the loop included."""
        snap = self._snapshot
        in_transit = self._sent_seqs - int(snap.get("sequences_taken_in", 0))
        return int(snap.get("num_requests_waiting", 0)) + in_transit

    # -- the loop's side (any thread) --------------------------------------------------

    def start(self) -> None:
        """Begin delivering the loop's output."""
        raise NotImplementedError

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: running requests are aborted and their streams closed."""
        raise NotImplementedError

    def _command(self, kind: str, payload: Any) -> None:
        raise NotImplementedError

    def _set_snapshot(self, stats: dict[str, Any]) -> None:
        """The loop's newest stats (a dict it never touches again)."""
        self._snapshot = MappingProxyType(stats)

    def _deliver(self, request_id: str, item: StreamDelta | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, StreamDelta | BaseException]]) -> None:
        """Route a turn's output to its streams: one wake-up of each event loop for all of
        it (32 streams a step were 32 wake-ups of the server's loop)."""
        puts: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        for request_id, item in items:
            if self.on_delta is not None and isinstance(item, StreamDelta):
                self.on_delta(item)
            target = self._streams.get(request_id)
            if target is not None:
                puts.setdefault(target[0], []).append((target[1], item))
        for loop, batch in puts.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, err: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, err)


class AsyncLLM(EngineFront):
    """Runs an `LLMEngine`'s loop in a background thread of this process.

    Args:
        engine: the engine to drive; owned by the loop thread from `start` on.
        max_waiting, on_delta: as `EngineFront`.
    """

    def __init__(self, engine: LLMEngine, *, max_waiting: int | None = None,
                 on_delta: Callable[[StreamDelta], None] | None = None) -> None:
        super().__init__(max_waiting=max_waiting, on_delta=on_delta)
        self.engine = engine
        self.checker = engine.checker
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self._loop = EngineLoop(engine, _ThreadSink(self))
        self._thread: threading.Thread | None = None
        self._set_snapshot(engine.stats())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ringserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: running requests are aborted and their streams closed."""
        self.accepting = False
        self._loop.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.close()

    def _command(self, kind: str, payload: Any) -> None:
        self._loop.put(kind, payload)

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as err:  # the loop itself broke: fail every stream
            logger.exception("engine loop died")
            self.dead = err
            self._fail_all(EngineDeadError(f"engine loop died: {err!r}"))
            return
        self._fail_all(EngineDeadError("the engine shut down"))


def _put_all(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for stream, item in batch:
        stream.put_nowait(item)


class _ThreadSink:
    """The loop's output into the front's queues (same process), a turn at a time; each
    snapshot is published at once, so it is never older than the deltas delivered."""

    def __init__(self, front: EngineFront) -> None:
        self.front = front
        self._items: list[tuple[str, StreamDelta | BaseException]] = []

    def send(self, request_id: str, item: StreamDelta | BaseException) -> None:
        self._items.append((request_id, item))

    def publish(self, stats: dict[str, Any]) -> None:
        self.front._set_snapshot(stats)

    def flush(self) -> None:
        if self._items:
            items, self._items = self._items, []
            self.front._deliver_all(items)


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the server answers 429."""
