"""Every failure as OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ringserve.engine import EngineDeadError, InvalidRequestError
from ringserve.engine.async_llm import QueueFullError
from ringserve.engine.loading import ModelLoadError
from ringserve.server.protocol import NEUTRAL_ONLY, FieldError

logger = logging.getLogger("ringserve.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error with its HTTP status and OpenAI fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def _encodable(text: str | None) -> str | None:
    """``text`` with any lone surrogate written as its escape: a message may quote the input,
    and a JSON body is encoded as UTF-8, which has no surrogates."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": _encodable(message),
                      "type": _TYPES.get(status, "invalid_request_error"),
                      "param": _encodable(param), "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | int | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=dict(headers) if headers else None)


def to_api_error(err: BaseException) -> APIError:
    """Map an engine or validation exception onto its HTTP status."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, InvalidRequestError):
        return APIError(400, str(err), param=err.param)
    if isinstance(err, FieldError):
        return APIError(400, str(err), param=err.field, code=err.code)
    if isinstance(err, QueueFullError):
        return APIError(429, str(err), code="queue_full")
    if isinstance(err, EngineDeadError):
        return APIError(503, str(err), code="engine_unavailable")
    if isinstance(err, ModelLoadError):
        return APIError(400, str(err), param="model")
    logger.exception("internal error", exc_info=err)
    kind = getattr(err, "kind", None) or type(err).__name__  # the core's type, if from there
    return APIError(500, f"internal error: {kind}", code="internal_error")


def _validation_param(errors: list[Any]) -> tuple[str, str | None]:
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in ("body", "query"):  # a field of the body, or a query parameter
        loc = loc[1:]
    param = ".".join(loc) if loc else None
    if first.get("type") == "extra_forbidden":
        return f"unsupported parameter: {param}", param
    if param in NEUTRAL_ONLY:
        return f"{param} is not supported by ringserve (only its neutral value)", param
    if first.get("type") in ("json_invalid", "json_type"):
        return "the body is not valid JSON", None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        message, param = _validation_param(errors) if errors else ("invalid request", None)
        for err in errors:  # a ValueError raised by a validator may carry its own field
            ctx = err.get("ctx") or {}
            if isinstance(ctx.get("error"), FieldError):
                api = to_api_error(ctx["error"])
                return error_response(api.status, api.message, api.param, api.code)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    async def _known(_: Request, exc: Exception) -> JSONResponse:
        api = to_api_error(exc)
        return error_response(api.status, api.message, api.param, api.code)

    # NOTE: one handler per known type: a handler for bare Exception runs inside
    # Starlette's ServerErrorMiddleware, which logs and re-raises even after answering.
    for kind in (InvalidRequestError, FieldError, QueueFullError, EngineDeadError,
                 ModelLoadError):
        app.add_exception_handler(kind, _known)
    app.add_exception_handler(Exception, _known)
