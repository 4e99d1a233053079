"""The errors of every loading step: each message says what is wrong and what to do."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model cannot be found, converted or read; the message says what to do."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable, but its `model_type` is not one we implement."""
