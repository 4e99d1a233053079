"""The gated MLP's ``gelu(gate, approximate="tanh") * up`` in one compiled pass
(`kernels.cpu_act`) against torch's two ops, on every bf16 value."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ringserve.engine.models.layers import MLP
from ringserve.kernels import cpu_act, cpu_build


def _torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_every_bf16_value_as_torchs(cpu_variant: str) -> None:
    """In every kernel variant (portable too: the GELU is torch's own table), the op is
    torch's on all 65,536 values of gate, so it is used."""
    assert cpu_act._agrees(cpu_variant)
    cpu_act._ops.pop(cpu_variant, None)
    assert cpu_act.usable()


def test_the_table_is_torchs_gelu_at_each_values_bits() -> None:
    table = cpu_act.table()
    for value in (0.0, -0.0, 1.0, -2.5, 3e38, float("inf"), float("-inf"), float("nan")):
        x = torch.tensor([value], dtype=torch.bfloat16)
        bits = int(x.view(torch.int16).item()) & 0xFFFF
        want = F.gelu(x.expand(64).contiguous(), approximate="tanh")[0]
        assert _same_bits(table[bits], want), value


def test_a_wrong_table_is_refused(cpu_variant: str) -> None:
    gate = torch.zeros(1, 64, dtype=torch.bfloat16)
    op = cpu_build.ops(cpu_variant).gelu_tanh_mul
    with pytest.raises(RuntimeError, match="table"):
        op(gate, gate, torch.zeros(1024, dtype=torch.bfloat16))


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
                    reason="needs the compiled CPU kernels (a C++ compiler)")
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
