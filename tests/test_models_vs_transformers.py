"""Our models against transformers on tiny random checkpoints of every family.

Each family gets a config with a small window that the block size does not divide (w=6,
b=4: R=2, C=8), saved with ``save_pretrained`` and loaded back by both sides. Logits must
match transformers (eager, float32) at every position over 6w tokens however the tokens are
fed, and greedy generation of 8w tokens must be identical to ``generate``.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.model_harness import RingHarness, load_ours
from tests.tiny_models import FAMILIES, B, W, make_checkpoint
from tests.tiny_models import hf_reference as reference
from tests.tiny_models import random_tokens as tokens


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[str, pathlib.Path]:
    return request.param, make_checkpoint(request.param, tmp_path_factory.mktemp("ckpt"))


def test_windows_are_what_transformers_uses(checkpoint: tuple[str, pathlib.Path]) -> None:
    family, path = checkpoint
    ours = load_ours(str(path))
    expected = {
        "llama": (None, None),
        "llama_yarn": (None, None),
        "llama3_rope": (None, None),
        "mistral": (W, W, W),
        "qwen2": (None, W, W),  # layers below max_window_layers stay full
        "phi3": (W, W),
        "gemma3_text": (W, W, None, W),
        "gemma2": (W, None, W, None),
        "olmo3": (W, W, W, None),
        "exaone4": (W, W, W, None),
        "cohere2": (W, W, W, None),
        "gpt_oss": (W, None, W, None),
        "gemma4_text": (W, W, None, W, W, None),
        "gemma4_moe": (W, None, W, None),
    }[family]
    assert ours.config.layer_windows == expected


@pytest.mark.parametrize("sizes", [[6 * W], [1], [3], [W], [3 * W], [2 * W, 1]],
                         ids=["prefill", "chunks1", "chunks3", "chunksW", "chunks3W",
                              "prefill_then_decode"])
def test_logits_match_at_every_position(checkpoint: tuple[str, pathlib.Path],
                                        sizes: list[int]) -> None:
    _family, path = checkpoint
    ids = tokens(6 * W, seed=len(sizes) * 7 + sizes[0])
    with torch.no_grad():
        expected = reference(path)(torch.tensor([ids])).logits[0]
    got = RingHarness(load_ours(str(path)), B, 6 * W).logits_in_chunks(ids, sizes)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_greedy_generation_is_token_identical(checkpoint: tuple[str, pathlib.Path]) -> None:
    _family, path = checkpoint
    prompt = tokens(W + 3, seed=11)
    new = 8 * W
    with torch.no_grad():
        out = reference(path).generate(torch.tensor([prompt]), max_new_tokens=new,
                                       min_new_tokens=new, do_sample=False)
    expected = out[0, len(prompt):].tolist()
    got = RingHarness(load_ours(str(path)), B, len(prompt) + new).greedy(prompt, new)
    assert got == expected
