"""The engine core process: scheduler, KV manager, model runner and sampler, alone with the
CPU (docs/design.md §11).

`core_main` is the process's entry (`CoreClient` starts it with multiprocessing's spawn).
It builds the `LLMEngine` (saying ``("resolved", folder)`` once the folder served is known,
before the weights load, so the API process reads the tokenizer meanwhile), says
``("ready", CoreInfo)`` (or ``("failed", why)``) and runs
the `EngineLoop` in its main thread; a reader thread takes the API process's commands off
one pipe, and each turn of the loop sends what it made down the other as one message: a
list of ``("stats", dict)``, ``("delta", StreamDelta)`` and ``("error", request_id,
WireError)`` in the order they happened. When the API process goes away (its pipe ends)
the core stops; signals are the API process's to handle (a Ctrl-C reaches the whole
process group), so the core ignores SIGINT and SIGTERM. While the engine loads nothing reads
the pipe, so a watchdog thread ends the core as soon as the API process is gone
(`_exit_with_parent`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ringserve.engine.config import EngineConfig
from ringserve.engine.engine_loop import EngineLoop, StreamDelta
from ringserve.engine.errors import EngineDeadError, InvalidRequestError
from ringserve.engine.request_check import RequestLimits

logger = logging.getLogger("ringserve.engine")
# Seconds between the watchdog's checks that the API process still lives.
PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class CoreInfo:
    """What the API process needs of a started core: to tokenize, check and name."""

    model_name: str
    model_path: str
    limits: RequestLimits
    eos_token_ids: list[int]
    stats: dict[str, Any]


@dataclass(frozen=True)
class WireError:
    """An exception as it crosses the pipe (exceptions do not all pickle)."""

    kind: str  # the original type's name
    message: str
    param: str | None = None

    @classmethod
    def of(cls, err: BaseException) -> WireError:
        return cls(type(err).__name__, str(err), getattr(err, "param", None))

    def rebuild(self) -> BaseException:
        if self.kind == "InvalidRequestError":
            return InvalidRequestError(self.message, param=self.param)
        if self.kind == "EngineDeadError":
            return EngineDeadError(self.message)
        return RequestFailedError(self.kind, self.message)


class RequestFailedError(RuntimeError):
    """An engine error that ended one request, raised in the core (``kind``: its type)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class _PipeSink:
    """Collects a turn's output and sends it as one message."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._batch: list[tuple[Any, ...]] = []
        self._stats: dict[str, Any] | None = None

    def send(self, request_id: str, item: StreamDelta | BaseException) -> None:
        if self._stats is not None:  # the stats before the deltas they explain
            self._batch.append(("stats", self._stats))
            self._stats = None
        if isinstance(item, StreamDelta):
            self._batch.append(("delta", item))
        else:
            self._batch.append(("error", request_id, WireError.of(item)))

    def publish(self, stats: dict[str, Any]) -> None:
        self._stats = stats

    def flush(self) -> None:
        if self._stats is not None:
            self._batch.append(("stats", self._stats))
            self._stats = None
        if self._batch:
            batch, self._batch = self._batch, []
            self.conn.send(("out", batch))


def core_main(config: EngineConfig, commands: Connection, outputs: Connection,
              log_level: str = "info", parent: int | None = None) -> None:
    """The core process: build the engine, then serve the commands until told to stop;
    ``parent``: the API process's pid, whose end ends this process at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent,), name="ringserve-core-parent",
                         daemon=True).start()
    # NOTE: the API process's format: start-up lines read the same whichever process logs
    # them (benchmarks/peers/servers.py reads the dtype and weight bytes from them).
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ringserve.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config, on_resolved=lambda path: outputs.send(("resolved", str(path))))
    except BaseException as err:
        logger.exception("the engine failed to start")
        outputs.send(("failed", f"{type(err).__name__}: {err}"))
        raise SystemExit(1) from None
    outputs.send(("ready", CoreInfo(engine.model_name, str(engine.model_path), engine.limits,
                                    sorted(engine.eos_token_ids), engine.stats())))
    loop = EngineLoop(engine, _PipeSink(outputs))
    reader = threading.Thread(target=_read_commands, args=(commands, loop),
                              name="ringserve-core-commands", daemon=True)
    reader.start()
    try:
        loop.run()
    except BaseException as err:
        logger.exception("engine loop died")
        outputs.send(("dead", f"engine loop died: {err!r}"))
        raise SystemExit(1) from None
    engine.close()
    outputs.send(("bye",))


def _exit_with_parent(parent: int) -> None:
    """Exit once ``parent`` (the API process) is gone: this process is then someone
    else's child. While the engine loads (minutes, for a model converted on first use) no
    pipe is read, and a core whose API process was SIGKILLed went on loading, holding the
    model's memory and writing its log lines into the next server's log, until it said
    "ready" to nobody. A parent-death signal (``prctl(PR_SET_PDEATHSIG)``) would not do: it
    follows the thread that started the process, and the API process starts the core from a
    thread that ends once the core is ready (`server.app`)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    logger.warning("the API process %d is gone: exiting", parent)
    os._exit(1)


def _read_commands(commands: Connection, loop: EngineLoop) -> None:
    while True:
        try:
            kind, payload = commands.recv()
        except (EOFError, OSError):  # the API process is gone
            logger.warning("the API process went away: stopping")
            loop.stop()
            return
        if kind == "shutdown":
            loop.stop()
            return
        loop.put(kind, payload)
