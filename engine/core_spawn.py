"""Starting the engine core process before anything heavy is imported (docs/design.md §11).

The server's process and its engine core each import torch, transformers and the rest
(~3 s each on two cores). Started from the app, the core began importing only after the
API process had finished: ~6 s of a start went by before the core read its first weight.
`spawn_core` needs only the standard library and `EngineConfig`, so `ringserve serve`
starts the core first and builds its app while the core imports beside it;
`CoreClient.launch` then waits for the core it was given (or starts one itself).
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ringserve.engine.config import EngineConfig

__all__ = ["SpawnedCore", "spawn_core"]


@dataclass
class SpawnedCore:
    """A started core process and this side's ends of its two pipes."""

    process: Any
    commands: Connection  # we write: requests, aborts, shutdown
    outputs: Connection  # we read: "resolved", "ready" / "error", then the outputs


def spawn_core(config: EngineConfig, log_level: str = "info") -> SpawnedCore:
    """Start the engine core process (multiprocessing's spawn) for ``config``; nothing is
    waited for."""
    ctx = multiprocessing.get_context("spawn")
    cmd_read, cmd_write = ctx.Pipe(duplex=False)
    out_read, out_write = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_core_entry,
                          args=(config, cmd_read, out_write, log_level, os.getpid()),
                          name="ringserve-core", daemon=True)
    process.start()
    cmd_read.close()
    out_write.close()  # ours closed: the pipe ends when the core's end does
    return SpawnedCore(process, cmd_write, out_read)


def _core_entry(*args: Any) -> None:
    """The child's target: `core_proc.core_main`, imported there, not here (it needs torch)."""
    from ringserve.engine.core_proc import core_main

    core_main(*args)
