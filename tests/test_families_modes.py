"""Every family through the engine in every mode, token-exact with transformers.

For each tiny checkpoint of `tests.tiny_models.FAMILIES`, greedy generation of 10 windows
from prompts longer than the ring (two of them sharing a prefix) must equal transformers'
``generate`` (float32, eager) whatever the engine does: block sizes that do and do not
divide the window, prefills cut into chunks, all prompts in one batch, prefix caching on
(a second round reads the first round's blocks) and off, ngram speculation on. Every run
ends with no read of an overwritten slot and every block back in the pool.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from ringserve.engine import LLM, SamplingParams, spec_decode
from tests.tiny_models import FAMILIES, W, hf_reference, make_checkpoint, make_llm, random_tokens

NEW = 10 * W
MODES: dict[str, dict[str, Any]] = {
    # w = 6, b = 4: the ring does not end on a block boundary; 8 tokens a step
    "b4_chunked_cached": dict(block_size=4),
    "b3_uncached": dict(block_size=3, enable_prefix_caching=False),
    "b4_ngram": dict(block_size=4, speculative_config={"method": "ngram",
                                                        "num_speculative_tokens": 3}),
}


def _prompts() -> list[list[int]]:
    motif = random_tokens(5, seed=5)
    prefix = random_tokens(9, seed=6)
    return [random_tokens(2 * W + 3, seed=7), prefix + random_tokens(4, seed=8),
            prefix + motif * 3, random_tokens(3 * W + 1, seed=9) + motif * 2]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[list[int]]]:
    """The checkpoint and transformers' greedy continuation of each prompt."""
    path = make_checkpoint(request.param, tmp_path_factory.mktemp("ckpt"))
    model = hf_reference(path)
    expected = []
    with torch.no_grad():
        for prompt in _prompts():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                 min_new_tokens=NEW, do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
    return path, expected


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_is_token_exact(family: tuple[pathlib.Path, list[list[int]]], mode: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path, expected = family
    # every draft is verified (whether one pays is learned from this machine's step times)
    monkeypatch.setattr(spec_decode.StepCost, "worth", lambda *_args: True)
    llm: LLM = make_llm(path, **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    for _round in range(2):  # the second round finds the first one's prefixes
        outs = llm.generate(prompts, params)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
    stats = llm.stats()
    assert stats["kv_read_misses"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0
    if MODES[mode].get("enable_prefix_caching", True):
        assert stats["prefix_cache_hits"] > 0
    if "speculative_config" in MODES[mode]:
        assert stats["spec_decode_num_accepted_tokens"] > 0
