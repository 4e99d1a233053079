"""Our own torch models for the HF families, running attention through the ring kernels."""

from __future__ import annotations

from ringserve.engine.models.config import (
    SUPPORTED_MODEL_TYPES,
    ModelConfig,
    UnsupportedConfigError,
    model_config_from_hf,
)
from ringserve.engine.models.decoder import CausalLM, KVCaches

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CausalLM",
    "KVCaches",
    "ModelConfig",
    "UnsupportedConfigError",
    "model_config_from_hf",
]
