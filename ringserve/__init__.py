"""ringserve: a paged inference server for sliding-window-attention models whose KV cache is
a ring (docs/design.md).

One import namespace: ``ringserve.engine``, ``ringserve.server``, ``ringserve.kernels``,
``ringserve.block_manager``, ``ringserve.configs``, and the offline API here::

    from ringserve import LLM, SamplingParams

The repository keeps its folders at the top (the project's layout); in the source tree
``ringserve/engine`` and the others are links to them, and the wheel installs them inside
this package (pyproject.toml's package-dir). Nothing heavy is imported until asked for
(``ringserve.block_manager`` needs no torch).
"""

from __future__ import annotations

from typing import Any

_OFFLINE = ("LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "LLMEngine",
            "RequestOutput", "CompletionOutput", "InvalidRequestError", "EngineDeadError")
__all__ = list(_OFFLINE)


def __getattr__(name: str) -> Any:
    if name in _OFFLINE:
        from ringserve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ringserve' has no attribute {name!r}")
