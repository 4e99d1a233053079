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

import os
import sys
from typing import Any

_OFFLINE = ("LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "LLMEngine",
            "RequestOutput", "CompletionOutput", "InvalidRequestError", "EngineDeadError")
__all__ = list(_OFFLINE)


def __getattr__(name: str) -> Any:
    if name in _OFFLINE:
        from ringserve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ringserve' has no attribute {name!r}")


class _InstalledKernelsFirst:
    """A top-level ``import kernels`` finds the installed package of that name (Hugging
    Face's, which transformers 5.25 requires and imports with its activations), never the
    repository's kernels/ folder, which is ``ringserve.kernels``.

    NOTE: the folder shadows it wherever the repository's root is on sys.path: under pytest
    (tests/ is a package), ``python -c`` / ``-m`` from the root, and the benchmarks that put
    the root first. transformers then failed at import ("cannot import name 'CUDAProperties'
    from 'kernels'")."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "kernels" or path is not None:
            return None
        from importlib.machinery import PathFinder

        entries = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != self.root]
        return PathFinder.find_spec(fullname, entries)


def _guard_kernels_name() -> None:
    root = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
    # only in the source tree: a wheel's ringserve/ sits in site-packages
    if not os.path.isdir(os.path.join(root, "kernels", "csrc")):
        return
    if not any(isinstance(f, _InstalledKernelsFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstalledKernelsFirst(root))


_guard_kernels_name()
