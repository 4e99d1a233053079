"""The engine: sequences, scheduler, model runner, models, sampler, loader, engine loop."""

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
