"""The engine: sequences, scheduler, model runner, models, sampler, loading, engine loop."""

# NOTE: OpenMP's waiting threads sleep at once (OMP_WAIT_POLICY=PASSIVE) unless the user
# chose a policy: libgomp reads it once, when torch loads it, so it is set here, before
# anything of ours imports torch (a program that imported torch first keeps its own).
# benchmarks/omp_wait.py, gemma-3-270m, 8 requests of 64 tokens, 2 cores (AMX machine,
# 2026-12-01): passive 66.7 tok/s alone and 39.1 beside one busy process (1.70x fall);
# libgomp's default spin 52.7 and 25.0 (2.11x); GOMP_SPINCOUNT=10000 65.1 and 30.0;
# transformers fell 2.58x in the same run. An earlier Zen 4 run found passive 10-25% slower
# alone at batch 1: set OMP_WAIT_POLICY=ACTIVE (or GOMP_SPINCOUNT) on a machine of your own.
# Our own kernels run on their own threads, which choose per call (kernels/csrc/thread_pool.h).
# Where torch is loaded already, libgomp has read its settings: the environment is left as
# it was, so that it still says what libgomp does (kernels/cpu_build.py's libgomp_sleeps).
import os as _os
import sys as _sys

if "torch" not in _sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(_os.environ):
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

# NOTE: the exports load when first asked for (PEP 562): the server's process starts its
# engine core before it imports torch, so that both import at once (engine/core_spawn.py)
_EXPORTS = {
    "LLM": "llm", "CompletionOutput": "outputs", "EngineConfig": "config",
    "EngineDeadError": "errors", "InvalidRequestError": "errors", "LLMEngine": "llm_engine",
    "RequestOutput": "outputs", "SamplingParams": "sampling_params",
    "StructuredOutputsParams": "sampling_params",
}

if _TYPE_CHECKING:
    from ringserve.engine.config import EngineConfig
    from ringserve.engine.errors import EngineDeadError, InvalidRequestError
    from ringserve.engine.llm import LLM
    from ringserve.engine.llm_engine import LLMEngine
    from ringserve.engine.outputs import CompletionOutput, RequestOutput
    from ringserve.engine.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> _Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ringserve.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"ringserve.engine.{module}"), name)


__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
