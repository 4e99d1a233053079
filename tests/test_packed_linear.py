"""The CPU bf16 path: oneDNN-packed linears (AVX-512 and up), compact linears (every CPU
class, `kernels/csrc/compact_gemm.cpp`), and fused projections.

References: a float64 matmul of the same bf16 weights (the packed and compact GEMMs), our own
unfused float32 model (fusing must not change a number), and transformers' model in bfloat16
for the whole bf16 model of every family, under every kernel variant this CPU runs.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from torch import nn

from ringserve.engine.loading import load_model
from ringserve.engine.models.packed_linear import (
    CompactLinear,
    PackedLinear,
    bucket_rows,
    can_pack,
    fuse_projections,
    pack_linears,
)
from ringserve.kernels import cpu_gemm, cpu_isa
from tests.model_harness import RingHarness, load_ours
from tests.tiny_models import FAMILIES, B, W, make_checkpoint, random_tokens

needs_pack = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")),
    reason=f"torch packs bf16 weights for oneDNN only with AVX-512 BW/VL/DQ; this CPU's class "
           f"is {cpu_isa.info().cls} (the compact path is tested instead)")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {family: make_checkpoint(family, root) for family in FAMILIES}


SHAPES = [(0,), (1,), (3,), (4,), (5,), (2, 3), (9,), (64,), (65,), (3, 50), (300,)]


@needs_pack
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, 96).to(torch.bfloat16)
    packed = PackedLinear(linear)
    got = packed(x)
    expected = nn.functional.linear(
        x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    assert got.shape == (*shape, 40) and got.dtype == torch.bfloat16
    # bf16 output: one rounding of a float32 accumulation (8 mantissa bits)
    torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=1e-3)
    assert packed.small == cpu_gemm.supports(linear.weight)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compact_linear_matches_float64(cpu_variant: str, shape: tuple[int, ...],
                                        dtype: torch.dtype) -> None:
    """bf16 weights widened in registers, float32 FMA, for bf16 or float32 activations."""
    torch.manual_seed(len(shape) * 100 + shape[-1])
    linear = nn.Linear(96, 40).to(torch.bfloat16)
    x = torch.randn(*shape, 96).to(dtype)
    layer = CompactLinear(linear)
    got = layer(x)
    expected = nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    assert got.shape == (*shape, 40) and got.dtype == dtype
    tol = {"rtol": 2**-7, "atol": 1e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5,
                                                                          "atol": 1e-5}
    torch.testing.assert_close(got.double(), expected, **tol)


@pytest.mark.parametrize("k", [640, 96, 100, 7], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 40])
def test_compact_gemm_every_row_count_and_width(cpu_variant: str, rows: int, k: int) -> None:
    """Both paths (weight rows side by side for few x rows, float32 tiles for many), the
    widths that leave a tail after the last vector, and each variant's vector width."""
    torch.manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k)
    w = (torch.randn(203, k) / 8).to(torch.bfloat16)
    bias = torch.randn(203)
    got = cpu_gemm.compact_linear(x, w, bias, variant=cpu_variant)
    expected = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_row_buckets_are_few_and_pad_little() -> None:
    """oneDNN compiles (and caches) a kernel per row count: a server's every batch size
    must map onto few of them (the cache keeps 1024, for every weight shape together),
    none padded by more than 1/8, and small batches not at all."""
    sizes = range(1, 4097)
    buckets = [bucket_rows(m) for m in sizes]
    assert all(b >= m for m, b in zip(sizes, buckets, strict=True))
    assert buckets == sorted(buckets)  # more rows never run at a smaller size
    assert all(b - m <= m / 8 for m, b in zip(sizes, buckets, strict=True))
    assert buckets[:32] == list(range(1, 33))
    assert all(bucket_rows(b) == b for b in buckets)  # a bucket is its own size
    assert len(set(buckets)) <= 90


@pytest.mark.parametrize("k", [640, 96, 100, 7], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("rows", range(0, 9))
def test_small_gemm_matches_float64(rows: int, k: int) -> None:
    """Every row count the kernel serves, and widths that are not a multiple of 32."""
    torch.manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    w = (torch.randn(200, k) / 8).to(torch.bfloat16)
    bias = torch.randn(200).to(torch.bfloat16)
    got = cpu_gemm.linear_small(x, w, bias)
    expected = x.double() @ w.double().T + bias.double()
    assert got.shape == (rows, 200) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fusing_projections_changes_no_logit(checkpoints: dict[str, pathlib.Path],
                                             family: str) -> None:
    path = checkpoints[family]
    ids = random_tokens(3 * W, seed=5)
    plain = RingHarness(load_ours(str(path)), B, 3 * W).logits_in_chunks(ids, [W, 1])
    model = load_ours(str(path))
    fused = fuse_projections(model)
    # q/k/v and gate/up per layer (phi3's come fused; a mixture of experts has no gate/up;
    # a Gemma 4 layer attending to another's K/V has q alone)
    cfg = model.config
    attention = sum(cfg.kv_source_of(i) == i for i in range(cfg.num_layers))
    mlps = 0 if cfg.num_experts and not cfg.moe_parallel else cfg.num_layers
    assert fused == attention + mlps or FAMILIES[family][0] == "Phi3Config"
    got = RingHarness(model, B, 3 * W).logits_in_chunks(ids, [W, 1])
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def bf16_references(checkpoints: dict[str, pathlib.Path]) -> dict[str, Any]:
    """Per family: the tokens, transformers' bf16 logits and its float64 logits (float32
    where its code has no float64 path: gpt-oss's grouped expert matmul)."""
    import transformers

    def logits(path: pathlib.Path, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="eager").eval()
        with torch.no_grad():
            return ref(torch.tensor([ids])).logits[0].double()

    refs = {}
    for family, path in checkpoints.items():
        ids = random_tokens(4 * W, seed=9)
        try:
            exact = logits(path, torch.float64, ids)
        except RuntimeError:
            exact = logits(path, torch.float32, ids)
        refs[family] = (ids, logits(path, torch.bfloat16, ids), exact)
    return refs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_model_matches_transformers_bf16(
        checkpoints: dict[str, pathlib.Path], bf16_references: dict[str, Any], family: str,
        cpu_variant: str) -> None:
    """`--dtype bfloat16` on every CPU class: oneDNN-packed linears from AVX-512 up, compact
    ones (float32 FMA over bf16 weights) below, as an AVX2-only CPU runs them."""
    path = checkpoints[family]
    ids, expected, exact = bf16_references[family]
    model = load_model(path, dtype=torch.bfloat16)
    kind = PackedLinear if can_pack(torch.bfloat16, torch.device("cpu")) else CompactLinear
    # oneDNN packs where the real CPU has AVX-512 too: the AVX-512 kernels emulated on an
    # AVX2 CPU take the compact linears (cpu_isa.onednn_bf16_linear)
    packs = cpu_variant not in ("avx2", "portable") and cpu_isa.info().has("avx512")
    assert kind is (PackedLinear if packs else CompactLinear)
    assert any(isinstance(m, kind) for m in model.modules())
    got = RingHarness(model, B, 4 * W).logits_in_chunks(ids, [W, 1]).double()
    # Both are bf16 approximations of the float64 model: ours must be no worse than
    # transformers' own bf16 run (with slack for a different order of roundings).
    ours_err = (got - exact).abs().max().item()
    theirs_err = (expected - exact).abs().max().item()
    assert ours_err <= 2 * theirs_err + 1e-2, (ours_err, theirs_err)
    agree = (got.argmax(-1) == exact.argmax(-1)).double().mean().item()
    assert agree >= 0.9, agree


@pytest.mark.parametrize("kind", [pytest.param(PackedLinear, marks=needs_pack), CompactLinear],
                         ids=["packed", "compact"])
def test_pack_linears_swaps_every_linear(checkpoints: dict[str, pathlib.Path],
                                         kind: type[nn.Module]) -> None:
    model = load_model(checkpoints["gemma3_text"], dtype=torch.bfloat16, pack=False)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model, kind) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(type(m) is kind for m in model.modules()) == linears


def test_auto_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig

    from ringserve.engine import startup
    from ringserve.engine.errors import InvalidRequestError

    cpu, cfg = torch.device("cpu"), LlamaConfig(dtype="float16")
    monkeypatch.setattr(startup, "cpu_bf16_units", lambda: ["AVX512-BF16"])
    dtype, why = startup.pick_dtype("auto", cpu, cfg)
    assert dtype is torch.bfloat16 and "AVX512-BF16" in why
    monkeypatch.setattr(startup, "cpu_bf16_units", lambda: [])
    dtype, why = startup.pick_dtype("auto", cpu, cfg)
    assert dtype is torch.float32 and "neither" in why
    assert startup.pick_dtype("auto", torch.device("cuda"), cfg)[0] is torch.float16
    assert startup.pick_dtype("float32", cpu, cfg) == (torch.float32, "asked for")
    with pytest.raises(InvalidRequestError, match="dtype must be") as err:
        startup.pick_dtype("int3", cpu, cfg)
    assert err.value.param == "dtype"


def test_engine_logs_its_dtype_choice(checkpoints: dict[str, pathlib.Path],
                                      caplog: pytest.LogCaptureFixture) -> None:
    from ringserve.engine import LLM
    from ringserve.engine.startup import cpu_bf16_units

    with caplog.at_level("INFO", logger="ringserve.engine"):
        llm = LLM(str(checkpoints["mistral"]), kv_cache_memory="4MiB", max_model_len=64)
    expected = torch.bfloat16 if cpu_bf16_units() else torch.float32
    assert llm.engine.dtype is expected
    assert any(r.getMessage().startswith(f"dtype {str(expected)[6:]} (auto: ")
               for r in caplog.records)
