"""The API process's side of the engine core process (docs/design.md §11).

`CoreClient.launch` spawns `engine.core_proc.core_main` and waits for its ``ready``; then
requests are tokenized and checked here (`RequestChecker` on the core's `RequestLimits`,
constraints compiled here and sent as text) and cross as `CheckedRequest`s; a reader thread
takes each turn's output off the pipe, publishes the stats snapshot and routes the deltas.

The core's death is noticed at once (its pipe ends): every open stream fails with
`EngineDeadError`, `dead` is set (so ``/health`` answers 503) and ``on_dead`` runs (the
server exits non-zero for its supervisor to restart it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ringserve.engine.async_llm import EngineFront
from ringserve.engine.config import EngineConfig
from ringserve.engine.core_proc import CoreInfo, WireError
from ringserve.engine.core_spawn import SpawnedCore, spawn_core
from ringserve.engine.engine_loop import StreamDelta
from ringserve.engine.errors import EngineDeadError
from ringserve.engine.loading import TokenizerLoad
from ringserve.engine.request_check import RequestChecker
from ringserve.engine.structured_output import StructuredOutputs

logger = logging.getLogger("ringserve.engine")


class EngineStartError(RuntimeError):
    """The engine core could not start; the message is the core's own."""


class CoreClient(EngineFront):
    """A front whose engine loop runs in a child process (use `launch`)."""

    def __init__(self, process: Any, commands: Connection, outputs: Connection,
                 info: CoreInfo, *, max_waiting: int | None = None,
                 on_delta: Callable[[StreamDelta], None] | None = None,
                 tokenizer: Any = None) -> None:
        from ringserve.engine.loading import load_tokenizer

        super().__init__(max_waiting=max_waiting, on_delta=on_delta)
        self.process, self._commands, self._outputs = process, commands, outputs
        self.model_name = info.model_name
        self.tokenizer = load_tokenizer(info.model_path) if tokenizer is None else tokenizer
        self.structured = StructuredOutputs(self.tokenizer, info.limits.vocab_size,
                                            info.eos_token_ids)
        self.checker = RequestChecker(self.tokenizer, info.limits, self.structured)
        self.on_dead: Callable[[BaseException], None] | None = None
        self._send_lock = threading.Lock()
        self._closing = False
        self._reader: threading.Thread | None = None
        self._set_snapshot(info.stats)

    @classmethod
    def launch(cls, config: EngineConfig, *, log_level: str = "info",
               max_waiting: int | None = None,
               spawned: SpawnedCore | None = None) -> CoreClient:
        """Start the core (or take ``spawned``, one `spawn_core` started for ``config``)
        and wait until its engine is built (a first start may convert a model for minutes:
        there is no deadline while the process lives).

        Raises:
            EngineStartError: the core failed to build its engine (its reason) or died.
        """
        core = spawned if spawned is not None else spawn_core(config, log_level)
        process, cmd_write, out_read = core.process, core.commands, core.outputs
        tokenizer: TokenizerLoad | None = None
        try:
            message = out_read.recv()
            if message[0] == "resolved":  # the folder is known: its tokenizer loads here
                tokenizer = TokenizerLoad(message[1])  # while the core loads the weights
                message = out_read.recv()
        except (EOFError, OSError):
            process.join(5)
            raise EngineStartError(f"the engine core process exited with code "
                                   f"{process.exitcode} before it was ready") from None
        if message[0] != "ready":
            process.join(30)
            raise EngineStartError(message[1])
        logger.info("engine core process %d ready", process.pid)
        return cls(process, cmd_write, out_read, message[1], max_waiting=max_waiting,
                   tokenizer=None if tokenizer is None else tokenizer.result())

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def start(self) -> None:
        self._reader = threading.Thread(target=self._read, name="ringserve-core-outputs",
                                        daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core: running requests are aborted (their streams get their last
        delta), then the process exits; one that does not is killed."""
        self.accepting = False
        self._closing = True
        with contextlib.suppress(OSError, ValueError):  # already gone
            self._send(("shutdown", None))
        if self._reader is not None:
            self._reader.join(timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine core did not stop in %g s: killing it", timeout)
            self.process.kill()
            self.process.join(5)
        self._fail_all(EngineDeadError("the engine shut down"))

    def _command(self, kind: str, payload: Any) -> None:
        if kind == "add":
            payload = payload.portable(self.structured)
        try:
            self._send((kind, payload))
        except (OSError, ValueError) as err:  # the core is gone: the reader says so
            raise EngineDeadError(f"the engine core is gone: {err}") from None

    def _send(self, message: tuple[str, Any]) -> None:
        with self._send_lock:
            self._commands.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self._outputs.recv()
            except (EOFError, OSError):
                break
            if message[0] == "out":
                items: list[tuple[str, StreamDelta | BaseException]] = []
                for entry in message[1]:
                    if entry[0] == "stats":  # at once: never older than what is delivered
                        self._set_snapshot(entry[1])
                    elif entry[0] == "delta":
                        items.append((entry[1].request_id, entry[1]))
                    else:
                        wire: WireError = entry[2]
                        items.append((entry[1], wire.rebuild()))
                self._deliver_all(items)
            elif message[0] == "dead":
                self._died(message[1])
                return
            elif message[0] == "bye":
                return
        if not self._closing:
            self.process.join(2)
            self._died(f"the engine core process (pid {self.pid}) died "
                       f"(exit code {self.process.exitcode})")

    def _died(self, why: str) -> None:
        logger.error("%s; failing %d open stream(s)", why, len(self._streams))
        err = EngineDeadError(why)
        self.dead = err
        self.accepting = False
        self._fail_all(err)
        if self.on_dead is not None:
            self.on_dead(err)
