"""The engine: sequences, scheduler, model runner, models, sampler, loading, engine loop."""

# NOTE: OpenMP's wait policy is left to the runtime's default (spin a while, then sleep).
# Measured on 2 cores, gemma-3-270m bf16, alone on the machine: passive waits made decode
# steps 10-25% slower (batch 1: 44-50 vs 36-42 ms; prefill 205 vs 165 ms), as every
# parallel region paid a futex wake-up. Beside another busy process spinning collapses
# instead (a decode run took 46 s spinning, 5.7 s passive): the tests, which run servers
# side by side, set OMP_WAIT_POLICY=PASSIVE, and so should anyone sharing a machine.

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams

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
