"""The gated MLP's ``gelu(gate, approximate="tanh") * up`` in one compiled pass
(`kernels.cpu_act`) against torch's two ops, on every bf16 value."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ringserve.engine.models.layers import MLP
from ringserve.kernels import cpu_act, cpu_build, cpu_isa


def _torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_every_bf16_value_as_torchs(cpu_variant: str) -> None:
    """In every kernel variant (portable too: the GELU is torch's own table), the op is
    torch's on all 65,536 values of gate as contiguous rows."""
    gate = cpu_act._every_bf16()
    up = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert _same_bits(cpu_act._bound(cpu_variant)(gate, up), _torch(gate, up))


def test_used_where_torch_agrees_with_itself(cpu_variant: str) -> None:
    """The op is used exactly where torch's bits for the halves of a fused [rows, 2n]
    tensor (the model's gate_up) equal its bits for the same values contiguous: on x86-64
    with this project's torch they do (so it is used); torch 2.6 and 2.10 on aarch64 gave
    other bits for some values of the strided view."""
    every = cpu_act._every_bf16()
    up = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    gate, u = torch.cat([every, up], dim=-1).chunk(2, dim=-1)
    torch_self_consistent = _same_bits(_torch(gate, u), _torch(every, up))
    assert cpu_act._agrees(cpu_variant) == torch_self_consistent
    if cpu_isa.info().arch in ("x86_64", "AMD64"):
        assert torch_self_consistent  # where this project's CI runs, the op is in use
    cpu_act._ops.pop(cpu_isa.info().variant, None)
    assert cpu_act.usable() == cpu_act._agrees(cpu_isa.info().variant)


def test_a_torch_whose_strided_bits_differ_turns_it_off(cpu_variant: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch's gelu gives other bits on a strided view than on the same values
    contiguous (as torch on aarch64 does), the op is not used: here torch is made so by
    flipping the last bit of one value of every strided result."""
    gelu = F.gelu

    def layout_dependent(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        out = gelu(x, approximate=approximate)
        if not x.is_contiguous():
            out = out.clone()
            out.view(torch.int16)[0, 1] ^= 1
        return out

    monkeypatch.setattr(F, "gelu", layout_dependent)
    assert not cpu_act._agrees(cpu_variant)


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
    assert cpu_act.gelu_tanh_mul(x[None], x[None]) is None  # not [rows, n]
    assert cpu_act.gelu_tanh_mul(x.t(), x.t()) is None  # not a unit last stride
    assert cpu_act.gelu_tanh_mul(x, x.double()) is None  # up of another dtype
    b = x.to(torch.bfloat16)
    assert cpu_act.gelu_tanh_mul(b[None], b[None]) is None  # not [rows, n]
    assert cpu_act.gelu_tanh_mul(b.t(), b.t()) is None  # not a unit last stride


@pytest.mark.skipif(not cpu_build.available() or not cpu_act.usable(),
                    reason="needs the compiled CPU kernels (a C++ compiler) and a torch whose "
                    "gelu bits do not depend on the layout (on aarch64 it does)")
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


def _gelu_times_up_f64(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The float64 tanh GELU of gate (float32 values), rounded to float32 as the op rounds
    it, times up in float64. 0.5 (1 + tanh(u)) is written sigmoid(2u), its equal: the
    first form cancels to 0 in float64 too once tanh(u) rounds to -1 (u < ~-19)."""
    g = gate.double()
    act = g * torch.sigmoid(2 * 0.7978845608028654 * (g + 0.044715 * g**3))
    return act.float().double() * up.double()


@pytest.mark.parametrize("n", [2048, 1000, 7])
def test_float32_pass_within_float64s_gelu(cpu_variant: str, n: int) -> None:
    """Every build's float32 pass (its vectors and its scalar tail) against float64 over
    gate values from 1e-3 to the far tails, where torch's own formula loses every digit on
    the negative side (1 + tanh(u) cancels)."""
    gen = torch.Generator().manual_seed(n)
    fused = torch.randn(8, 2 * n, generator=gen)
    fused[:, :n] *= torch.tensor([1e-3, 0.1, 1, 2, 3, 5, 10, 30])[:, None]
    gate, up = fused.chunk(2, dim=-1)  # views with a row stride, as the model's
    got = cpu_build.ops(cpu_variant).gelu_tanh_mul_f32(gate, up).double()
    want = _gelu_times_up_f64(gate, up)
    # the argument 2u is rounded (a few float32 ulps), and e^-|2u| moves by |2u| times that
    # relative error: so the bound grows with |2u| on the negative tail (80 at gate -9)
    g = gate.double()
    two_u = (2 * 0.7978845608028654 * (g + 0.044715 * g**3)).abs()
    # and from 2u < -87 on the op answers 0 (its exp floor): |gate * up| e^-87 < 1e-35 here
    assert ((got - want).abs() <= (2e-6 + 2e-7 * two_u) * want.abs() + 1e-35).all()


def test_float32_pass_special_values_as_torchs(cpu_variant: str) -> None:
    values = [float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 3e38, -3e38, 0.0, -0.0,
              1e-30, -1e-30, 1e-44, -10.0, -50.0, 60.0]
    gate = torch.tensor([values * 2])  # both the vector pass and the scalar tail
    up = torch.ones_like(gate)
    got = cpu_build.ops(cpu_variant).gelu_tanh_mul_f32(gate, up)
    assert _same_bits(got, _torch(gate, up)), (got, _torch(gate, up))


def test_float32_rows_take_the_pass_on_vector_builds() -> None:
    """The wrapper answers float32 rows with this CPU's pass where it has a vector one (not
    the portable build, slower than torch), else leaves them to torch."""
    gate, up = torch.randn(3, 100), torch.randn(3, 100)
    op = cpu_act.f32_op()
    got = cpu_act.gelu_tanh_mul(gate, up)
    if cpu_isa.info().variant == "portable" or not cpu_build.available():
        assert op is None and got is None
    else:
        assert op is not None and got is not None and torch.equal(got, op(gate, up))
        assert torch.allclose(got, _torch(gate, up), rtol=1e-5, atol=1e-6)
