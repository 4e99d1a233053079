"""Errors the engine raises for bad input; each names the offending parameter."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``param`` names the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""
