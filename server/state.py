"""What the app keeps between requests: the settings, the engine front, its lifecycle."""

from __future__ import annotations

import enum
import glob
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # NOTE: torch loads with the app, after the core is started (cli.serve)
    from ringserve.engine.async_llm import EngineFront

CPU_STEP_TOKENS = 512  # the served default of --max-num-batched-tokens on the CPU


def _nvidia_device_nodes() -> bool:
    """Whether this machine has an NVIDIA device node (/dev/nvidia0, ...)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class ServeArgs:
    """`ringserve serve` flags (see server/cli.py for their help)."""

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    quantization: str = "auto"
    int16_activations: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str | None = None
    block_size: int = 16
    kv_cache_memory: str | None = None
    memory_budget: str | None = None  # None: "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: step_tokens() picks by device
    max_prefill_slowdown: float | None = None
    packed_head_rows: int | None = None
    packed_rows: int | str | None = "auto"  # None: off
    rounded_copy_rows: int | None = None  # None: off
    greedy_head: str = "auto"
    scheduling_policy: str = "fcfs"
    kv_events_config: str | None = None  # vLLM's JSON: the prefix cache's events over ZMQ
    max_model_len: int | None = None
    max_waiting: int | None = 256
    api_key: str | None = None
    log_level: str = "info"
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 4 * 2**20
    enable_prefix_caching: bool = True
    tool_call_parser: str | None = "hermes"
    speculative_config: str | None = None
    debug_kv: bool = False
    cache_dir: str | None = None
    admission_shapes: str | None = None  # "256:256,4096:512": admission gauges per shape
    metrics_compat: str | None = None  # "vllm": vLLM's metric names beside ours
    engine_core: str = "process"  # "process": the engine in its own process; "thread"

    def step_tokens(self) -> int:
        """``--max-num-batched-tokens``, or where unset: 2048 on CUDA (vLLM's server
        default), ``CPU_STEP_TOKENS`` on the CPU (at least ``max_num_seqs``: every decode
        fits a step). On a CPU the linears reach their throughput by ~256 rows, so longer
        steps only make a burst of prompts wait for each other: 32 prompts of 128 tokens at
        once on 2 Zen 4 cores, TTFT p50 1.6-1.8 s at 2048 against 0.73-0.81 s at 512, output
        tok/s within this host's noise (docs/benchmarks.md)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self._on_cuda():
            return 2048
        return max(CPU_STEP_TOKENS, self.max_num_seqs)

    def _on_cuda(self) -> bool:
        """`startup.pick_device`'s answer, without torch where no NVIDIA device node exists
        (torch would find no CUDA device either): `cli.serve` starts the engine core before
        this process imports torch (engine/core_spawn.py)."""
        if self.device == "cpu" or (self.device is None and not _nvidia_device_nodes()):
            return False
        from ringserve.engine.startup import pick_device

        return pick_device(self.device).type == "cuda"

    def engine_kwargs(self) -> dict[str, Any]:
        return dict(model=self.model, dtype=self.dtype, quantization=self.quantization,
                    int16_activations=self.int16_activations,
                    kv_cache_dtype=self.kv_cache_dtype, device=self.device,
                    block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                    memory_budget=self.memory_budget,
                    max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.step_tokens(),
                    max_prefill_slowdown=self.max_prefill_slowdown,
                    packed_head_rows=self.packed_head_rows,
                    packed_rows=self.packed_rows, rounded_copy_rows=self.rounded_copy_rows,
                    greedy_head=self.greedy_head,
                    scheduling_policy=self.scheduling_policy,
                    kv_events_config=self.kv_events_config,
                    max_model_len=self.max_model_len, debug_kv=self.debug_kv,
                    enable_prefix_caching=self.enable_prefix_caching,
                    cache_dir=self.cache_dir, speculative_config=self.speculative_config)


@dataclass
class ServerState:
    args: ServeArgs
    phase: Phase = Phase.STARTING
    llm: EngineFront | None = None
    model_name: str = ""
    error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Any = None
    exit_code: int = 0  # the process's, once it stops (1: the engine core died)
    spawned: Any = None  # a core started before the app was built (`core_spawn.SpawnedCore`)

    def ready_llm(self) -> EngineFront:
        """The engine front, or a 503 while starting, stopping or after a failed start."""
        from ringserve.server.errors import APIError

        if self.phase is not Phase.READY or self.llm is None:
            detail = f": {self.error}" if self.error else ""
            # NOTE: a stopping replica's clients (or nginx) should go elsewhere at once.
            retry = {Phase.STARTING: "10", Phase.STOPPING: "1"}.get(self.phase)
            raise APIError(503, f"the server is {self.phase.value}{detail}",
                           code="server_not_ready",
                           headers={"Retry-After": retry} if retry else None)
        return self.llm


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"256:256,4096:512"`` -> [(256, 256), (4096, 512)].

    Raises:
        ValueError: not that form, or a number below 1.
    """
    shapes = []
    for part in text.split(","):
        prompt, sep, out = part.strip().partition(":")
        if not sep or not prompt.isdigit() or not out.isdigit() or min(int(prompt), int(out)) < 1:
            raise ValueError(f"admission shape {part!r} is not PROMPT:MAX_TOKENS (both >= 1)")
        shapes.append((int(prompt), int(out)))
    return shapes
