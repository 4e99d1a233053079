"""The engine: sequences, scheduler, model runner, models, sampler, loader, engine loop."""

import os

# NOTE: OpenMP threads that spin while they wait turn a CPU shared with other work (a
# second server, a test, a benchmark peer) into a 10x slowdown: measured here, a gemma-3
# decode run took 46 s with the default spin and 5.7 s with passive waits, beside one other
# busy process on 2 cores. It must be set before torch loads OpenMP; a user's own value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
