"""The decode step's layers without their modules (`engine.models.fast_decode`).

The reference is the module path itself (``RINGSERVE_FAST_DECODE=0``): the fast path
promises the same ops on the same tensors in the same order, so the same bits, which the
modules' own tests compare with transformers. Greedy runs of several prompts of different
lengths (prefill steps take the modules, decode steps the fast path) must give the same
tokens and the same logprobs, bit for bit.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from ringserve.engine import LLM, SamplingParams
from ringserve.engine.models import fast_decode
from ringserve.kernels import cpu_act, cpu_build, cpu_isa, cpu_quant
from tests.tiny_models import make_checkpoint, random_tokens

PROMPTS = [random_tokens(n, seed=n) for n in (3, 11, 30, 17, 5)]


def _run(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fast: bool,
         compiled: bool = True, built: list[int] | None = None,
         **kwargs: Any) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens and their logprobs of every prompt, and the decode steps the fast
    path ran (``compiled``: its loop in C++ where the layers allow; each time that loop is
    made is appended to ``built``)."""
    monkeypatch.setenv("RINGSERVE_FAST_DECODE", "1" if fast else "0")
    monkeypatch.setenv("RINGSERVE_DECODE_LAYERS", "1" if compiled else "0")
    runs = []
    real = fast_decode.FastDecode.run
    real_loop = fast_decode.FastDecode._compiled_loop

    def counted(self: fast_decode.FastDecode, *args: object) -> torch.Tensor:
        runs.append(1)
        return real(self, *args)  # type: ignore[arg-type]

    def made(self: fast_decode.FastDecode, ropes: list[int]) -> Any:
        if built is not None:
            built.append(1)
        return real_loop(self, ropes)

    monkeypatch.setattr(fast_decode.FastDecode, "run", counted)
    monkeypatch.setattr(fast_decode.FastDecode, "_compiled_loop", made)
    kwargs.setdefault("dtype", "bfloat16")
    llm = LLM(str(path), kv_cache_memory="8MiB", max_model_len=96, max_num_seqs=4,
              **kwargs)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[v for lp in o.outputs[0].logprobs for v in (lp.logprob, *(p for _, p in lp.top))]
                for o in outs]
    return tokens, logprobs, len(runs)


# (the tiny models' MLP is 96 wide, which the compiled bf16 GELU pass does not take; 128
# does; float32 rows with int16 activations are the AVX2 class's default). The last column:
# whether every linear is one compiled op and the GELU a compiled pass, so that the loop
# runs in C++ (decode_layers.cpp): float32 rows over int16 activations, or bf16 rows over
# the few-row linears (with --packed-rows 2, only the steps of one row: the one-row
# decodes at the end); with int4 the 96-wide down_proj stays float (its k is no multiple of
# 64).
CASES = [("gemma3_text", "int8", None, None, "bfloat16", False),
         ("gemma3_text", "int4", None, None, "bfloat16", False),
         ("gemma3_text", "none", None, None, "bfloat16", False),
         ("gemma2", "int8", None, None, "bfloat16", False),
         ("gemma3_text", "int8", 2, None, "bfloat16", False),
         ("gemma3_text", "int8", None, 128, "bfloat16", True),
         ("gemma3_text", "int8", 2, 128, "bfloat16", True),
         ("gemma3_text", "int8", None, 128, "float32", True),
         ("gemma3_text", "int8", None, None, "float32", True),
         ("gemma3_text", "int4", None, None, "float32", False)]


@pytest.mark.parametrize(("family", "quantization", "packed_rows", "mlp", "dtype", "loop"),
                         CASES)
def test_the_fast_layers_give_the_modules_bits(cpu_variant: str, tmp_path: pathlib.Path,
                                               monkeypatch: pytest.MonkeyPatch, family: str,
                                               quantization: str, packed_rows: int | None,
                                               mlp: int | None, dtype: str,
                                               loop: bool) -> None:
    if packed_rows is not None and not cpu_quant.has_tiles():
        pytest.skip(f"the {cpu_variant} build keeps no bf16 tiles (they need AVX512-BF16)")
    if packed_rows is not None and not cpu_isa.onednn_bf16_linear():
        pytest.skip(f"the packed rows' copies need oneDNN's bf16 packing (AVX-512 BW/VL/DQ), "
                    f"which this {cpu_isa.info().detected} CPU lacks (its {cpu_variant} "
                    "kernels run emulated)")
    path = make_checkpoint(family, tmp_path,
                           overrides=None if mlp is None else {"intermediate_size": mlp})
    kwargs: dict[str, object] = {"quantization": quantization, "packed_rows": packed_rows,
                                 "dtype": dtype}
    if dtype == "float32":
        kwargs["int16_activations"] = "on"
    built: list[int] = []
    fast_tokens, fast_logprobs, ran = _run(path, monkeypatch, True, built=built, **kwargs)
    tokens, logprobs, off = _run(path, monkeypatch, False, **kwargs)
    assert off == 0
    assert fast_tokens == tokens
    assert fast_logprobs == logprobs
    assert (ran > 0) == cpu_build.available()  # the decode-only steps took the fast path
    # the loop runs in C++ (decode_layers.cpp) where the build has the GELU pass of the
    # rows' dtype; made once (the norms' scales do not change)
    compiled = loop and (cpu_act.f32_op() if dtype == "float32" else cpu_act._op()) is not None
    assert built == ([1] if compiled else [])
    if compiled:  # and the Python loop it replaces gives the same bits
        py_tokens, py_logprobs, _ = _run(path, monkeypatch, True, compiled=False, **kwargs)
        assert (py_tokens, py_logprobs) == (tokens, logprobs)


@pytest.mark.parametrize("family", ["llama", "olmo3"])
def test_other_layouts_keep_their_modules(tmp_path: pathlib.Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          family: str) -> None:
    path = make_checkpoint(family, tmp_path)
    _, _, ran = _run(path, monkeypatch, True, quantization="int8")
    assert ran == 0
