"""The FastAPI app: lifespan owns the engine; thin routers; errors in OpenAI's shape.

The model loads in a background thread after the socket opens, so `/health` answers 503
("starting") during a first start's minute-long conversion instead of refusing connections.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ringserve.engine import EngineConfig, LLMEngine
from ringserve.engine.async_llm import AsyncLLM, EngineFront
from ringserve.engine.core_client import CoreClient, EngineStartError
from ringserve.engine.core_spawn import SpawnedCore
from ringserve.server.errors import error_response, install_error_handlers
from ringserve.server.metrics import Metrics
from ringserve.server.protocol import ErrorResponse
from ringserve.server.routes import chat, completions, misc
from ringserve.server.state import Phase, ServeArgs, ServerState, parse_shapes

logger = logging.getLogger("ringserve.server")
PROTECTED = ("/v1/", "/tokenize", "/detokenize")
# Seconds between the engine's failure (the core's death, or a start that failed) and this
# process's exit: the streams it failed write their error events, and /health answers 503
# with the reason meanwhile.
CORE_DEATH_EXIT_S = 1.0


def _start_engine(state: ServerState) -> None:
    """Start the engine (its core process, by default) and its front (runs in a thread)."""
    args = state.args
    try:
        config = EngineConfig(**args.engine_kwargs())
        llm: EngineFront
        if args.engine_core == "process":
            llm = CoreClient.launch(config, log_level=args.log_level,
                                    max_waiting=args.max_waiting, spawned=state.spawned)
            llm.on_dead = lambda err: _core_died(state, err)
        else:
            llm = AsyncLLM(LLMEngine(config), max_waiting=args.max_waiting)
        state.model_name = args.served_model_name or llm.model_name
        shapes = parse_shapes(args.admission_shapes) if args.admission_shapes else []
        state.metrics = Metrics(state.model_name, llm.stats, llm.limits.spec, shapes,
                                compat=args.metrics_compat)
        llm.on_delta = state.metrics.on_delta
        llm.start()
        state.llm = llm
        if state.phase is Phase.STARTING:  # not when a SIGTERM came during the load
            state.phase = Phase.READY
        logger.info("ready: serving %r", state.model_name)
    except Exception as err:
        logger.exception("the engine failed to start")
        # NOTE: a server that cannot serve exits (a killed core, a truncated shard, a model
        # that does not fit): answering 503 "failed" until someone kills it left compose
        # and systemd users looking at "loading" forever
        _fail(state, str(err) if isinstance(err, EngineStartError)
              else f"{type(err).__name__}: {err}")


def _core_died(state: ServerState, err: BaseException) -> None:
    """The engine core process is gone: `_fail`."""
    _fail(state, str(err))


def _fail(state: ServerState, why: str) -> None:
    """The engine cannot serve: say why on /health and in the log, and exit 1 (a supervisor
    restarts the server) once the failed streams have had a moment to go out."""
    logger.error("exiting in %g s: %s", CORE_DEATH_EXIT_S, why)
    state.error = why
    state.phase = Phase.FAILED
    state.exit_code = 1
    timer = threading.Timer(CORE_DEATH_EXIT_S, os.kill, (os.getpid(), signal.SIGTERM))
    timer.daemon = True
    timer.start()


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    loader = threading.Thread(target=_start_engine, args=(state,), name="ringserve-load",
                              daemon=True)
    loader.start()
    try:
        yield
    finally:
        state.phase = Phase.STOPPING
        # NOTE: a stop during a first start's conversion does not wait for it (bounded);
        # the loader is a daemon thread and goes with the process.
        await asyncio.get_running_loop().run_in_executor(
            None, loader.join, state.args.shutdown_timeout)
        if state.llm is not None:
            await asyncio.get_running_loop().run_in_executor(None, state.llm.shutdown)
            stats = state.llm.stats()
            logger.info("stopped: %d KV blocks in use, %d read misses",
                        stats["kv_blocks_used"], stats["kv_read_misses"])
        else:
            logger.info("stopped")


class BodyLimit:
    """413 for bodies over ``limit`` bytes, by Content-Length or as they stream in."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._reject(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"request body is larger than {self.limit} bytes",
                                  code="body_too_large")
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


class Guard:
    """The API key on the protected paths (401 without it), and every answer of 400 or more
    counted by status (`Metrics.rejected`).

    A plain ASGI middleware: Starlette's ``@app.middleware("http")`` hands each chunk of a
    streaming answer from one task to another through a memory stream, which cost a stream
    about a fifth of this process's time a token (py-spy, one greedy stream).
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = self.state.args.api_key
        if key and scope["path"].startswith(PROTECTED):
            header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                self._rejected(401)
                response = error_response(
                    401, "missing or wrong API key (Authorization: Bearer ...)",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self._rejected(message["status"])
            await send(message)

        await self.app(scope, receive, counted)

    def _rejected(self, status: int) -> None:
        metrics = self.state.metrics
        if metrics is not None:
            metrics.rejected(status)


def create_app(args: ServeArgs, spawned: SpawnedCore | None = None) -> FastAPI:
    """The app for ``args``; the engine starts when the app's lifespan starts (its core
    process is ``spawned`` where `cli.serve` started it already)."""
    app = FastAPI(title="ringserve", version=misc.VERSION, lifespan=lifespan)
    app.state.server = ServerState(args=args, spawned=spawned)
    install_error_handlers(app)

    app.add_middleware(Guard, state=app.state.server)
    app.add_middleware(BodyLimit, limit=args.max_body_bytes)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(misc.router)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        state: ServerState = app.state.server
        if state.metrics is None:
            return error_response(503, "metrics are available once the model is loaded",
                                  code="server_not_ready")
        return Response(generate_latest(state.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


ERRORS = {"400": "bad input", "401": "missing or wrong API key", "404": "unknown model",
          "413": "body too large", "429": "waiting queue full", "500": "internal error",
          "503": "starting or stopping"}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with our error statuses (OpenAI's body) instead of its 422."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ErrorResponse.model_json_schema(
        ref_template="#/components/schemas/{model}")
    for name, sub_schema in components["ErrorResponse"].pop("$defs", {}).items():
        components[name] = sub_schema
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path in schema.get("paths", {}).values():
        for op in path.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status, text in ERRORS.items():
                responses.setdefault(status, {"description": text, "content": ref})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    app.openapi_schema = schema
    return schema


__all__ = ["create_app"]
