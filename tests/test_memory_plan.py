"""The process's memory, planned once (issue 66; docs/design.md §12).

- bf16 weights stay bf16 under float32 activations (the CPUs without bf16 arithmetic): the
  model holds the checkpoint's bytes, not twice them, and computes what transformers
  computes on the widened weights.
- Loading streams: the loader's peak is the model plus about one tensor, and the
  checkpoint's pages never become the process's resident memory.
- The budget: a model that cannot fit is refused before it loads, naming memory_budget;
  the KV pool is what the budget leaves, at most what max_num_seqs sequences of
  max_model_len need; the plan is logged and in the engine's stats.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from ringserve.engine import LLM
from ringserve.engine.errors import InvalidRequestError
from ringserve.engine.loading.checkpoint import iter_weights, stored_tensors
from ringserve.engine.loading.errors import ModelLoadError
from ringserve.engine.memory_plan import (
    GiB,
    MiB,
    estimate_weights,
    loading_allocations,
    pick_budget,
)
from ringserve.engine.models.layers import WideningEmbedding
from ringserve.engine.models.packed_linear import CompactLinear
from ringserve.kernels import cpu_build
from tests.model_harness import RingHarness, load_ours
from tests.tiny_models import B, W, hf_reference, make_checkpoint, random_tokens

ROOT = pathlib.Path(__file__).resolve().parents[1]


def as_bf16(path: pathlib.Path) -> pathlib.Path:
    """The checkpoint with every float tensor stored as bf16 (as published models are)."""
    (file,) = path.glob("*.safetensors")
    tensors = safetensors.torch.load_file(str(file))
    safetensors.torch.save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                                 for k, v in tensors.items()}, str(file),
                                metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def bf16_gemma(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return as_bf16(make_checkpoint("gemma3_text", tmp_path_factory.mktemp("bf16")))


@pytest.mark.skipif(not cpu_build.available(), reason="needs the CPU kernels (a C++ compiler)")
def test_bf16_weights_stay_bf16_under_float32_activations(bf16_gemma: pathlib.Path) -> None:
    model = load_ours(str(bf16_gemma), torch.float32)
    linears = [m for m in model.modules() if isinstance(m, CompactLinear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert not [m for m in model.modules() if type(m) is torch.nn.Linear]
    embed = model.model.embed_tokens
    assert isinstance(embed, WideningEmbedding) and embed.weight.dtype == torch.bfloat16
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    stored = sum(t.numel() * t.element_size() for _, t in iter_weights(bf16_gemma))
    # the norms' few weights are float32; every matrix is held in its stored bytes
    assert held < 1.05 * stored, (held, stored)
    ids = random_tokens(4 * W, seed=7)
    with torch.no_grad():
        expected = hf_reference(bf16_gemma)(torch.tensor([ids])).logits[0]
    got = RingHarness(model, B, 4 * W).logits_in_chunks(ids, [W, 1, 3])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_iter_weights_reads_what_safetensors_reads(bf16_gemma: pathlib.Path,
                                                   tmp_path: pathlib.Path) -> None:
    (file,) = bf16_gemma.glob("*.safetensors")
    theirs = safetensors.torch.load_file(str(file))
    ours = dict(iter_weights(bf16_gemma))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype
               for k in ours)
    assert stored_tensors(bf16_gemma) == {k: ("BF16", tuple(v.shape)) for k, v in theirs.items()}
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in bf16_gemma.iterdir():
        data = f.read_bytes()
        (cut / f.name).write_bytes(data[:-100] if f.suffix == ".safetensors" else data)
    with pytest.raises(ModelLoadError, match="is truncated: tensor"):
        list(iter_weights(cut))


# A loader alone in a process: its resident memory before, its peak, and after.
LOADER = """
import json, sys, torch
import ringserve
from ringserve.engine.loading import load_hf_config
from ringserve.engine.loading.build import load_model
from ringserve.engine.memory_plan import loading_allocations, resident_bytes
from ringserve.kernels import cpu_build
from ringserve.engine.kv_cache import model_layer_groups
from ringserve.engine.models import CausalLM, model_config_from_hf
cpu_build.available()
# the runtime, once: transformers imported, torch's meta-device machinery
config = load_hf_config(sys.argv[1])
cfg = model_config_from_hf(config)
with torch.device("meta"):
    CausalLM(cfg, model_layer_groups(cfg))
def hwm():  # VmHWM: this process's own peak (getrusage's survives the exec from pytest)
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024
before = resident_bytes()
assert hwm() < before + 64 * 2**20  # measured from near the peak so far
quantization = sys.argv[2] if len(sys.argv) > 2 else "none"
with loading_allocations():
    model = load_model(sys.argv[1], dtype=torch.float32, hf_config=config,
                       quantization=quantization)
peak = hwm()
held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
print(json.dumps(dict(before=before, peak=peak, after=resident_bytes(), held=held)))
"""


@pytest.mark.skipif(not cpu_build.available(), reason="needs the CPU kernels (a C++ compiler)")
def test_loading_peaks_at_the_model_plus_about_one_tensor(tmp_path: pathlib.Path) -> None:
    """A model with a 64 MiB embedding and 9 more MiB of layers, stored bf16: the loader
    never holds much more than the model and its largest tensor, and what it holds after
    is the model (no freed temporaries kept, no file pages)."""
    path = as_bf16(make_checkpoint("llama", tmp_path, overrides=dict(
        vocab_size=32768, hidden_size=1024, intermediate_size=1024, num_attention_heads=8,
        num_key_value_heads=2)))
    largest = 32768 * 1024 * 2
    out = subprocess.run([sys.executable, "-c", LOADER, str(path)], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    slack = 48 * MiB  # libraries' own lazy allocations and the allocator's rounding
    assert m["peak"] - m["before"] <= m["held"] + largest + slack, m
    assert m["after"] - m["before"] <= m["held"] + slack, m


def test_a_model_that_cannot_fit_is_refused_before_it_loads(
        bf16_gemma: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ringserve.engine import llm_engine

    def loads(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(llm_engine, "load_model", loads)
    with pytest.raises(InvalidRequestError, match="does not fit") as err:
        LLM(str(bf16_gemma), dtype="float32", memory_budget="1MiB")
    assert err.value.param == "memory_budget"
    assert "GiB" in str(err.value)


@pytest.mark.skipif(not cpu_build.available(), reason="needs the CPU kernels (a C++ compiler)")
def test_the_kv_pool_is_what_the_budget_leaves(bf16_gemma: pathlib.Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from ringserve.engine import startup

    # the runtime's resident memory, as the engine measures it, held still (it moves by a
    # few MiB between two engines of one process)
    monkeypatch.setattr(startup, "resident_bytes", lambda: 300 * MiB)
    kw = dict(dtype="float32", block_size=B, max_num_seqs=4, max_model_len=256,
              max_num_batched_tokens=16)
    roomy = LLM(str(bf16_gemma), memory_budget="8GiB", **kw).engine
    plan, spec = roomy.memory_plan, roomy.kv.spec
    # every request's KV is known: no more than max_num_seqs sequences of max_model_len
    one = spec.pool_blocks_needed(256) * spec.block_bytes
    assert plan.kv == 4 * one and roomy.capacity.max_sequences == 4
    assert plan.budget == 8 * GiB and plan.total < plan.budget
    stats = roomy.stats()["memory_plan_bytes"]
    assert stats["kv"] == plan.kv and stats["total"] == plan.total
    # a budget that leaves room for two and a half such sequences: two
    tight = plan.weights + plan.copies + plan.workspace + int(2.5 * one)
    small = LLM(str(bf16_gemma), memory_budget=str(tight), **kw).engine
    assert small.memory_plan.kv <= 2.5 * one and small.capacity.max_sequences == 2
    assert small.memory_plan.total <= tight
    with pytest.raises(InvalidRequestError, match="not one sequence") as err:
        LLM(str(bf16_gemma), memory_budget=str(tight - 2 * one), **kw)
    assert err.value.param == "memory_budget"
    # kv_cache_memory keeps overriding the KV part
    fixed = LLM(str(bf16_gemma), memory_budget="8GiB", kv_cache_memory="1MiB", **kw).engine
    assert fixed.memory_plan.kv <= MiB


@pytest.mark.parametrize(("value", "expected"), [("20GiB", 20 * GiB), (1024, 1024),
                                                 ("512MiB", 512 * MiB)])
def test_budget_sizes(value: str | int, expected: int) -> None:
    assert pick_budget(value) == (expected, "set")


def test_budget_shares_and_errors() -> None:
    auto, why = pick_budget(None)
    half, _ = pick_budget("0.45")
    assert auto is not None and half is not None and "90%" in why
    assert abs(half - auto / 2) < 0.02 * auto  # both shares of the same memory
    for bad in ("lots", "-1", "0", "1.5x"):
        with pytest.raises(ValueError, match="memory_budget"):
            pick_budget(bad)


def test_the_estimate_counts_the_served_format() -> None:
    stored = {"e": ("BF16", (1000, 64)), "n": ("BF16", (64,)),
              "x_blocks": ("U8", (4, 32, 2, 16)), "x_scales": ("U8", (4, 32, 2))}
    f32 = estimate_weights(stored, act_bytes=4, keeps_bf16=False, quantization="none")
    kept = estimate_weights(stored, act_bytes=4, keeps_bf16=True, quantization="none")
    blocks = 4 * 32 * 2 * 17  # MXFP4 as stored
    assert f32 == 4 * 64000 + 4 * 64 + blocks
    assert kept == 2 * 64000 + 4 * 64 + blocks
    widened = estimate_weights(stored, act_bytes=2, keeps_bf16=False, quantization="none",
                               mxfp4_native=False)
    assert widened == 2 * 64000 + 2 * 64 + 2 * 4 * 32 * 2 * 32
    with loading_allocations():  # a no-op anywhere but glibc, never an error
        torch.empty(1 << 20)


def test_a_server_logs_its_plan_and_exports_it(bf16_gemma: pathlib.Path,
                                               tmp_path: pathlib.Path) -> None:
    import httpx

    from tests.server_utils import run_server

    with run_server(bf16_gemma, "--dtype", "float32", "--block-size", str(B),
                    "--max-model-len", "256", "--max-num-seqs", "4",
                    "--memory-budget", "4GiB", log_dir=tmp_path) as server:
        text = httpx.get(f"{server.url}/metrics").text
    parts = {line.split('part="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
             for line in text.splitlines()
             if line.startswith("ringserve:memory_plan_bytes{")}
    assert set(parts) == {"budget", "weights", "copies", "kv", "workspace", "total"}
    assert parts["budget"] == 4 * GiB
    assert parts["total"] == parts["weights"] + parts["copies"] + parts["kv"] + \
        parts["workspace"] <= parts["budget"]


def test_the_plan_names_its_parts() -> None:
    from ringserve.engine.memory_plan import MemoryPlan

    plan = MemoryPlan(10 * GiB, weights=GiB, copies=0, kv=2 * GiB, workspace=GiB // 2)
    assert plan.total == 3.5 * GiB
    assert plan.describe() == ("memory plan: weights 1.00 GiB + copies 0.00 GiB + KV 2.00 GiB"
                               " + workspace 0.50 GiB = 3.50 GiB of a budget of 10.00 GiB")
