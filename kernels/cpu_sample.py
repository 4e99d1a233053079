"""Greedy decoding's pick on the CPU: each row's first maximum in one compiled pass.

`first_max(logits)` is ``logits.max(dim=-1).indices`` (the first maximum, as argmax) for a
[rows, vocab] tensor; bf16 and float32 CPU rows go through `csrc/first_max.cpp` (which asks
torch for a row holding a NaN), others through torch, so the answer is torch's in every case.
"""

from __future__ import annotations

import torch

from ringserve.kernels.cpu_build import available, ops


def first_max(logits: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the index of each row's first maximum (torch's for a row with NaN)."""
    if (logits.dim() != 2 or logits.device.type != "cpu" or logits.shape[1] == 0
            or logits.dtype not in (torch.float32, torch.bfloat16) or not available()):
        return logits.max(dim=-1).indices
    rows = logits if logits.stride(1) == 1 else logits.contiguous()
    # NOTE: the op answers a row holding a NaN with torch's max itself (which propagates
    # NaN); checking its answers here cost two small ops a step, ~50 us each in a decode
    # step, whose caches the weights have just swept.
    out: torch.Tensor = ops().first_max(rows)
    return out
