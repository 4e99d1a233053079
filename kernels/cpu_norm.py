"""RMSNorm and (norm +) rotary embedding in one compiled pass each, for CPU tensors.

Callers check `supports(x)` and otherwise keep their own torch code; these functions compute
the same thing in float32 and round once at the end (`csrc/norm_rope.cpp`).
"""

from __future__ import annotations

import torch

from ringserve.kernels.cpu_build import available, ops


def supports(x: torch.Tensor, float32: bool = False) -> bool:
    """Whether the compiled ops take ``x``: a bf16 CPU tensor (float32 too where the caller
    allows it), with the ops built.

    NOTE: float32 only on request: the one pass sums in another order than transformers'
    op sequence (~1e-7 relative), and a float32 model is otherwise token-exact with it.
    """
    ok = x.dtype == torch.bfloat16 or (float32 and x.dtype == torch.float32)
    return ok and x.device.type == "cpu" and available()


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * scale`` over the last dim, in float32, in x's dtype.

    Args:
        x: [..., d] with a unit last stride.
        scale: float32 [d], the effective weight (Gemma: ``1 + w``).
    """
    flat = x.reshape(-1, x.shape[-1])
    out: torch.Tensor = ops().rms_norm(flat, scale, eps)
    return out.view(x.shape)


def add_rms_norm(res: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``res + rms_norm(x, scale, eps)`` in one pass, rounded as the two ops are (the norm's
    output to x's dtype, then the add): a residual add after a post-norm.

    Args:
        res: contiguous, x's shape and dtype.
        x: [..., d] with a unit last stride.
    """
    d = x.shape[-1]
    out: torch.Tensor = ops().add_rms_norm(res.reshape(-1, d), x.reshape(-1, d), scale, eps)
    return out.view(x.shape)


def norm_rope(x: torch.Tensor, scale: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Per head: an optional RMSNorm (``scale`` float32 [d]) then the half-split rotary
    embedding of the first ``cos.shape[-1]`` features.

    Args:
        x: [tokens, heads, d], unit last stride (a view of a fused projection is fine).
        cos, sin: [tokens, 1, rot] in x's dtype.

    Returns:
        A contiguous [tokens, heads, d] tensor.
    """
    rot = cos.shape[-1]
    c = cos.reshape(-1, rot).contiguous()
    s = sin.reshape(-1, rot).contiguous()
    out: torch.Tensor = ops().norm_rope(x, scale, c, s, eps)
    return out
