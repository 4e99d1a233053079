"""The gated MLP's ``gelu(gate, approximate="tanh") * up`` in one compiled pass
(`kernels.cpu_act`) against torch's two ops, on every bf16 value."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ringserve.engine.models.layers import MLP
from ringserve.kernels import cpu_act, cpu_build

# the kernel variants whose vectors are those torch's own kernels use at this capability
SAME_VECTORS = {"AVX512": ("avx512", "avx512_bf16"), "AVX2": ("avx2",)}


def _torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_every_bf16_value_as_torchs(cpu_variant: str) -> None:
    """Where the build's vectors are torch's own, the op is torch's on all 65,536 values
    (then it is used); elsewhere it may differ, and then it must not be used."""
    capability = torch.backends.cpu.get_cpu_capability()
    agrees = cpu_act._agrees(cpu_variant)
    if cpu_variant in SAME_VECTORS.get(capability, ()):
        assert agrees
    cpu_act._ops.pop(cpu_variant, None)
    assert cpu_act.usable() == agrees


@pytest.mark.parametrize("rows", [1, 3, 32, 161])
@pytest.mark.parametrize("n", [64, 2048, 1000, 32])
def test_the_wrapper_answers_torchs_bits_or_nothing(cpu_variant: str, rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    fused = (torch.randn(rows, 2 * n, generator=gen) * 3).to(torch.bfloat16)
    gate, up = fused.chunk(2, dim=-1)  # views with a row stride, as the model's
    got = cpu_act.gelu_tanh_mul(gate, up)
    if n % 64 or not cpu_act.usable():  # torch's own vector steps: 64 values
        assert got is None
    else:
        assert got is not None and _same_bits(got, _torch(gate, up))


def test_other_inputs_are_left_to_torch() -> None:
    x = torch.randn(4, 64)
    assert cpu_act.gelu_tanh_mul(x, x) is None  # float32
    b = x.to(torch.bfloat16)
    assert cpu_act.gelu_tanh_mul(b[None], b[None]) is None  # not [rows, n]
    assert cpu_act.gelu_tanh_mul(b.t(), b.t()) is None  # not a unit last stride


@pytest.mark.skipif(not cpu_build.available() or not cpu_act.usable(),
                    reason="needs the compiled pass to equal torch's GELU on this CPU "
                    "(x86 vectors of torch's width: AVX2 or AVX-512)")
@pytest.mark.parametrize("fused", [True, False])
def test_the_mlp_uses_it_and_keeps_its_bits(monkeypatch: pytest.MonkeyPatch,
                                            fused: bool) -> None:
    cfg = SimpleNamespace(hidden_act="gelu_pytorch_tanh", fused_qkv=fused, hidden_size=64,
                          mlp_bias=False, intermediate_of=lambda layer: 256)
    torch.manual_seed(0)
    mlp = MLP(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
    x = torch.randn(7, 64).to(torch.bfloat16)
    calls = []
    real = cpu_act.gelu_tanh_mul
    monkeypatch.setattr(cpu_act, "gelu_tanh_mul",
                        lambda g, u: calls.append(g.shape) or real(g, u))
    with torch.inference_mode():
        got = mlp(x)
        mlp.gelu_tanh = False
        want = mlp(x)
    assert calls == [torch.Size([7, 256])]
    assert torch.equal(got, want)
