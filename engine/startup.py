"""Start-up decisions: the device, and how much memory the KV pools get."""

from __future__ import annotations

import logging

import torch

from block_manager import KVCacheSpec, parse_size
from engine.config import DEFAULT_CPU_KV_MEMORY, EngineConfig
from engine.errors import InvalidRequestError

logger = logging.getLogger("ringserve.engine")


def pick_device(name: str | None) -> torch.device:
    """``name``, or CUDA when one is there, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device 'cuda' asked for, but no CUDA device is visible",
                                  param="device")
    return device


def kv_memory_bytes(config: EngineConfig, device: torch.device,
                    profile_peak: int | None = None) -> int:
    """Bytes for the KV pools.

    Explicit ``kv_cache_memory`` wins. On the CPU the default is 2 GiB. On CUDA it is
    ``gpu_memory_utilization`` of the device's total memory, less what the weights and one
    profiled max-size step (``profile_peak``, bytes) already took.
    """
    if config.kv_cache_memory is not None:
        try:
            return parse_size(config.kv_cache_memory)
        except ValueError as err:
            raise InvalidRequestError(str(err), param="kv_cache_memory") from None
    if device.type != "cuda":
        return parse_size(DEFAULT_CPU_KV_MEMORY)
    total = torch.cuda.get_device_properties(device).total_memory
    used = profile_peak if profile_peak is not None else torch.cuda.max_memory_allocated(device)
    free = int(total * config.gpu_memory_utilization) - used
    if free <= 0:
        raise InvalidRequestError(
            f"no GPU memory left for the KV cache: weights and activations take {used} bytes "
            f"of {total}", param="gpu_memory_utilization")
    return free


def describe(spec: KVCacheSpec, num_blocks: tuple[int, ...], memory: int) -> str:
    """The KV pool in one line for the start-up log."""
    used = sum(n * spec.bytes_per_block(i) for i, n in enumerate(num_blocks))
    return f"KV cache: {used / 2**20:.1f} MiB of {memory / 2**20:.1f} MiB budget"
