"""Rotary tables against transformers' own RoPE initialisation (modeling_rope_utils)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ringserve.engine.models.config import UnsupportedConfigError, _rope
from ringserve.engine.models.layers import Rotary

# gpt-oss-like (factor 32, no truncation), OLMo-3-like (theta 5e5, factor 8), DeepSeek-like
# (mscale ratio), a given attention factor, and a tiny one whose ramp covers most pairs
YARN = [
    {"factor": 32.0, "original_max_position_embeddings": 4096, "rope_theta": 150000.0,
     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    {"factor": 8.0, "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
     "mscale": 1.0, "mscale_all_dim": 0.707},
    {"factor": 8.0, "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
     "attention_factor": 1.2},
    {"factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
]


@pytest.mark.parametrize("params", YARN)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_yarn_matches_transformers(params: dict[str, object], head_dim: int) -> None:
    params = {"rope_type": "yarn", **params}
    original = int(params["original_max_position_embeddings"])  # type: ignore[call-overload]
    cfg = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, rope_parameters=dict(params),
        max_position_embeddings=int(original * float(params["factor"])))  # type: ignore[arg-type]
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = Rotary(_rope(dict(params), "test"), head_dim)
    torch.testing.assert_close(ours.inv_freq, inv_freq.float(), rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(attention, rel=1e-12)
    # the tables carry the factor: |cos|^2 + |sin|^2 = factor^2 at every position
    cos, sin = ours.cos_sin(torch.arange(50), 50, torch.float32)
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, attention**2))
    # and YaRN is not the plain table: some pairs are interpolated
    plain = 1.0 / (float(params["rope_theta"]) ** (  # type: ignore[arg-type]
        torch.arange(0, head_dim, 2).float() / head_dim))
    assert not torch.allclose(ours.inv_freq, plain)


def test_yarn_without_its_lengths_is_refused() -> None:
    with pytest.raises(UnsupportedConfigError, match="original_max_position_embeddings"):
        _rope({"rope_type": "yarn", "factor": 4.0}, "test")
    with pytest.raises(UnsupportedConfigError, match="dynamic"):
        _rope({"rope_type": "dynamic", "factor": 4.0}, "test")


@pytest.mark.parametrize(("partial", "head_dim", "factor"),
                         [(0.25, 512, 1.0), (0.5, 32, 1.0), (1.0, 64, 1.0), (0.25, 256, 8.0)])
def test_proportional_matches_transformers(partial: float, head_dim: int, factor: float) -> None:
    # Gemma 4's full layers: 0.25 of the 256 pairs of a 512-dim head rotate, the rest not
    params = {"rope_type": "proportional", "partial_rotary_factor": partial,
              "rope_theta": 1e6, "factor": factor}
    cfg = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                                   head_dim=head_dim, rope_parameters=dict(params))
    inv_freq, attention = ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu")
    ours = Rotary(_rope(dict(params), "test"), head_dim)
    assert attention == 1.0 and ours.rot_dim == head_dim
    torch.testing.assert_close(ours.inv_freq, inv_freq.float(), rtol=1e-6, atol=0)
    # it is not the plain partial rotary (exponents over the rotated part only)
    rot = int(head_dim * partial)
    plain = 1.0 / (1e6 ** (torch.arange(0, rot, 2).float() / rot)) / factor
    assert not torch.allclose(ours.inv_freq[: rot // 2], plain) or partial == 1.0
