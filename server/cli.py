"""The `ringserve` command line: `serve` (flags as `vllm serve`) and `generate`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
import yaml

from ringserve.server.state import Phase, ServeArgs, ServerState, parse_shapes

if TYPE_CHECKING:
    from ringserve.engine.core_spawn import SpawnedCore

logger = logging.getLogger("ringserve.server")
# Seconds after --shutdown-timeout for the aborted requests' last chunks to go out before
# uvicorn cancels what is still open: an orchestrator's grace period must cover both.
ABORT_GRACE_S = 10

def _row_count(text: str | int, words: tuple[str, ...]) -> int | str:
    """A row count (>= 1) or one of ``words``; a ValueError otherwise."""
    if str(text).lower() in words:
        return str(text).lower()
    rows = int(text)
    if rows < 1:
        raise ValueError(text)
    return rows


def _rows_or_off(text: str | int) -> int | str:
    """A row count or "off" (argparse names the flag when it is neither)."""
    return _row_count(text, ("off",))


def _rows_or_auto(text: str | int) -> int | str:
    """A row count, "auto" or "off" (argparse names the flag when it is none of them)."""
    return _row_count(text, ("auto", "off"))


FLAGS: list[tuple[str, Callable[[str], Any], str]] = [
    ("model", str, "preset name, HF folder or .gguf file"),
    ("served-model-name", str, "the model name clients send"),
    ("host", str, "address to bind (default 127.0.0.1: this machine only)"),
    ("port", int, "port to bind"),
    ("dtype", str, "auto, float32, bfloat16 or float16"),
    ("quantization", str, "weights: auto, none, int8, int4 or gguf"),
    ("int16-activations", str, "auto, on or off: quantized linears round float32 activations "
     "to int16 blocks for integer dot products (auto: on CPUs without bf16 arithmetic)"),
    ("kv-cache-dtype", str, "auto (the model's dtype; bf16 under int16 activations) or "
     "bfloat16 (a float32 model on the "
     "CPU: half the KV bytes)"),
    ("device", str, "cpu, cuda or cuda:N (default: CUDA if present)"),
    ("block-size", int, "tokens per KV block"),
    ("kv-cache-memory", str, "bytes for the KV cache (one pool for all layers), e.g. 2GiB "
     "(default: what --memory-budget leaves after the weights, their copies and the "
     "workspace, at most what max-num-seqs sequences of max-model-len tokens need)"),
    ("memory-budget", str, "what the engine process may hold in all: auto (90%% of what "
     "the machine or its cgroup has available at start), a share such as 0.8, or a size "
     "such as 20GiB; a model whose weights do not fit is refused before it loads"),
    ("max-num-seqs", int, "sequences running at once"),
    ("max-num-batched-tokens", int, "tokens per engine step (unset: 512 on the CPU, at "
     "least max-num-seqs; 2048 on CUDA)"),
    ("max-prefill-slowdown", float, "while streams decode, prefill chunks keep a step within "
     "this factor of a decode-only step (e.g. 2; default: no cap)"),
    ("packed-head-rows", int, "steps of at least this many rows multiply a quantized "
     "output head by a copy widened to bf16 once (faster for large batches; costs about "
     "vocab x hidden x 2 bytes, logged; AVX-512/AMX CPUs; default: 2 where --packed-rows "
     "auto packs with one-byte copies, 5 where it packs without, else off)"),
    ("packed-rows", _rows_or_auto, "the same for every quantized linear: steps and "
     "prefill chunks of at least this many rows multiply by copies widened to bf16 once "
     "(about 2 bytes a parameter more, logged; AVX-512/AMX CPUs; steps of up to 16 rows "
     "take a second copy at one byte a parameter); auto: from 2 rows where the copies are "
     "the kernels' bf16 and one-byte tiles (AVX512-BF16/AMX) and fit in a quarter of the "
     "available memory; off"),
    ("rounded-copy-rows", _rows_or_off, "steps and prefill chunks of at least this many "
     "rows multiply every quantized linear but the head by oneDNN's bf16 GEMM over a copy "
     "of its weight rounded to bf16 (faster than the AMX tiles from ~150 rows; inexact: 8 "
     "significant bits a weight; about 2 bytes a parameter more, logged; AVX-512/AMX "
     "CPUs); default off"),
    ("greedy-head", str, "auto or off: greedy rows of multi-row steps take their token from "
     "an int8 pass over a one-byte copy of an int8 output head and the exact logits of the "
     "few rows that can be the maximum (the same token; AVX512-VNNI CPUs; copy logged)"),
    ("kv-events-config", str, "vLLM's KV events, e.g. '{\"enable_kv_cache_events\": true, "
     "\"endpoint\": \"tcp://*:5557\"}': what the prefix cache stores and evicts, on a ZMQ "
     "PUB socket for a router (docs/metrics.md; default: off)"),
    ("max-model-len", int, "prompt + output tokens at most"),
    ("max-waiting", int, "waiting sequences before 429"),
    ("api-key", str, "require 'Authorization: Bearer KEY' on /v1 routes"),
    ("log-level", str, "debug, info, warning or error"),
    ("shutdown-timeout", float, "seconds a SIGTERM lets running requests finish before "
     "the rest are aborted"),
]


def defaults() -> dict[str, Any]:
    text = importlib.resources.files("ringserve.configs").joinpath("server.yaml").read_text()
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringserve",
        description="A paged inference server for sliding-window-attention models.")
    sub = parser.add_subparsers(dest="command", required=True)
    base = defaults()
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    gen = sub.add_parser("generate", help="one completion from the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    for p in (serve, gen):
        for flag, kind, help_text in FLAGS:
            key = flag.replace("-", "_")
            if p is gen and key in ("host", "port", "api_key", "max_waiting"):
                continue
            p.add_argument(f"--{flag}", type=kind, default=base.get(key),
                           help=f"{help_text} (default: {base.get(key)})")
    for p in (serve, gen):
        p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=base.get("enable_prefix_caching", True),
                       help="reuse the K/V of prompt prefixes computed before (default: "
                       f"{base.get('enable_prefix_caching', True)})")
    for p in (serve, gen):
        p.add_argument("--speculative-config", default=base.get("speculative_config"),
                       help='vLLM\'s, as JSON: \'{"method": "ngram", '
                       '"num_speculative_tokens": 3, "prompt_lookup_max": 4, '
                       '"prompt_lookup_min": 2}\' (default: off)')
    serve.add_argument("--tool-call-parser", choices=["hermes", "openai", "none"],
                       default=base.get("tool_call_parser") or "none",
                       help="how tool_choice \"auto\" reads calls from the output: hermes "
                       "tags, or openai (gpt-oss's harmony messages, also read by default "
                       "for a model whose chat template writes them); none: refuse \"auto\" "
                       f"(default: {base.get('tool_call_parser')})")
    serve.add_argument("--admission-shapes", type=_shapes,
                       default=base.get("admission_shapes"),
                       help="request shapes PROMPT:MAX_TOKENS (comma-separated) whose "
                       "admission answers /metrics exports as gauges, e.g. 256:256,4096:512 "
                       f"(default: {base.get('admission_shapes')})")
    serve.add_argument("--metrics-compat", choices=["vllm", "none"],
                       default=base.get("metrics_compat") or "none",
                       help="also export /metrics under another server's names: vllm "
                       "(vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ... for "
                       "gateways and dashboards built for vLLM; docs/metrics.md)")
    for p in (serve, gen):
        p.add_argument("--scheduling-policy", choices=["fcfs", "lpm"],
                       default=base.get("scheduling_policy") or "fcfs",
                       help="admission order: fcfs (arrival) or lpm (with prefix caching: "
                       "the waiting prompt with the most tokens cached first, none passed "
                       f"over more than 8 times) (default: {base.get('scheduling_policy')})")
    serve.add_argument("--engine-core", choices=["process", "thread"],
                       default=base.get("engine_core") or "process",
                       help="where the engine loop runs: process (its own process, beside "
                       "this HTTP one; its death makes the server exit 1) or thread (in "
                       f"this process) (default: {base.get('engine_core') or 'process'})")
    serve.add_argument("--debug-kv", action="store_true",
                       help="check every ring read against a shadow (slow; for tests)")
    return parser


def _shapes(text: str | None) -> str | None:
    """``PROMPT:MAX_TOKENS[,...]``, checked (argparse names the flag when it is not)."""
    if text is None:
        return None
    parse_shapes(text)
    return text


def _serve_args(ns: argparse.Namespace) -> ServeArgs:
    fields = {f.name for f in dataclasses.fields(ServeArgs)}
    kwargs = {k: v for k, v in vars(ns).items() if k in fields and v is not None}
    if kwargs.get("tool_call_parser") == "none":
        kwargs["tool_call_parser"] = None
    if kwargs.get("metrics_compat") == "none":
        kwargs["metrics_compat"] = None
    for rows in ("packed_rows", "rounded_copy_rows"):
        if kwargs.get(rows) == "off":
            kwargs[rows] = None
    return ServeArgs(**kwargs)


class GracefulServer(uvicorn.Server):
    """uvicorn with a bounded drain.

    On the first SIGTERM (or SIGINT) the listener closes (new connections are refused),
    requests that reach an open connection get 503 with Retry-After, and the running ones
    finish for up to ``shutdown_timeout`` seconds; then the rest are aborted (streams end
    with finish_reason "abort", blocks go back), their responses go out and the process
    exits 0. A second signal aborts everything and exits at once.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self._deadline: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            logger.warning("second signal: aborting every request and exiting now")
            self._abort_all()
            self.force_exit = True
        else:
            self._begin_drain()
        super().handle_exit(sig, frame)
        # NOTE: uvicorn re-raises the signal after its shutdown (the process would die of
        # it); a requested stop that went well exits 0, which orchestrators expect.
        self._captured_signals = [s for s in self._captured_signals
                                  if s not in (signal.SIGTERM, signal.SIGINT)]

    def _begin_drain(self) -> None:
        if self.state.phase is not Phase.FAILED:  # a dead core's 503 keeps saying why
            self.state.phase = Phase.STOPPING
        llm = self.state.llm
        running = llm.num_running if llm is not None else 0
        logger.info("draining: %d request(s) in flight get up to %g s to finish",
                    running, self.shutdown_timeout)
        self._deadline = threading.Timer(self.shutdown_timeout, self._abort_all)
        self._deadline.daemon = True
        self._deadline.start()

    def _abort_all(self) -> None:
        llm = self.state.llm
        if llm is not None and llm.num_running:
            logger.warning("drain timeout: aborting %d request(s)", llm.num_running)
        if llm is not None:
            llm.abort_all()


def serve(ns: argparse.Namespace) -> int:
    args = _serve_args(ns)
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0; got {args.shutdown_timeout}")
    url = f"http://{args.host}:{args.port}"
    print(f"ringserve: loading {args.model}; serving on {url} (GET {url}/health says when "
          f"ready). Try:\n  curl {url}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"prompt\": \"Once upon a time\", \"max_tokens\": 32}}'", flush=True)
    spawned = _spawn_early(args)
    from ringserve.server.app import create_app  # torch loads here, beside the core's

    app = create_app(args, spawned=spawned)
    # NOTE: uvicorn's own bound is a backstop only: at shutdown_timeout the requests are
    # aborted and their last chunks written; cancelling a connection would cut them off.
    # NOTE: h11, not httptools where installed: httptools refuses a request whose header
    # holds a control character with a plain-text 400 before the app sees it, where every
    # error of ours is OpenAI's JSON body (tests/test_fuzz_api.py); it saved ~0.05 ms of
    # this process's time a streamed token, uvloop (taken when installed) ~0.2
    config = uvicorn.Config(app, host=args.host, port=args.port, http="h11",
                            log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=int(args.shutdown_timeout)
                            + ABORT_GRACE_S)
    GracefulServer(config, app.state.server, args.shutdown_timeout).run()
    return int(app.state.server.exit_code)


def _spawn_early(args: ServeArgs) -> SpawnedCore | None:
    """The engine core, started now: it imports torch and the rest while this process
    imports the app (`engine.core_spawn`). None where the engine runs in this process, or
    where its settings are refused (the app's start then fails with the reason)."""
    from ringserve.engine.config import EngineConfig
    from ringserve.engine.core_spawn import spawn_core

    if args.engine_core != "process":
        return None
    try:
        config = EngineConfig(**args.engine_kwargs())
    except ValueError:
        return None
    return spawn_core(config, args.log_level)


def generate(ns: argparse.Namespace) -> int:
    from ringserve.engine import LLM, SamplingParams

    args = _serve_args(ns)
    kwargs = args.engine_kwargs()
    llm = LLM(kwargs.pop("model"), **kwargs)
    out = llm.generate(ns.prompt, SamplingParams(max_tokens=ns.max_tokens,
                                                 temperature=ns.temperature))
    print(ns.prompt + out[0].outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return serve(ns) if ns.command == "serve" else generate(ns)
    except ValueError as err:
        print(f"ringserve: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
