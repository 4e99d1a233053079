"""Prefix caching end to end on tiny checkpoints: the same tokens with it on and off.

Every engine runs with ``debug_kv=True`` (each cached position a step reads is checked
against the shadow of slot contents) and every test ends with no read miss, nothing
preempted and every block back in the pool. The engine with caching off is the reference;
it is checked against transformers in tests/test_engine.py.
"""

from __future__ import annotations

import pathlib

import pytest

from ringserve.engine import LLM, SamplingParams
from tests.tiny_models import W, make_checkpoint, make_llm, random_tokens

GREEDY = dict(temperature=0.0, ignore_eos=True)
FAMILIES = ["mistral", "gemma3_text", "llama"]  # sliding only, mixed, full only


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {family: make_checkpoint(family, root) for family in FAMILIES}


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, **GREEDY))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [4, 3])  # w = 6: not divided, divided
@pytest.mark.parametrize("prefix_len", [3, 9, 5 * W])  # under, about, several rings
def test_outputs_equal_with_caching_on_and_off(
        checkpoints: dict[str, pathlib.Path], engines: list[LLM], family: str,
        block_size: int, prefix_len: int) -> None:
    path = checkpoints[family]
    on = make_llm(path, block_size=block_size)
    off = make_llm(path, block_size=block_size, enable_prefix_caching=False)
    engines += [on, off]
    prefixes = [random_tokens(prefix_len, seed=100 + i) for i in range(2)]
    rounds = [[p + random_tokens(2 + i, seed=10 * r + i) for i, p in enumerate(prefixes)]
              for r in range(3)]  # the later rounds find the first round's prefixes
    for prompts in rounds:
        assert run(on, prompts, 3 * W) == run(off, prompts, 3 * W)
    stats = on.stats()
    assert stats["prefix_cache_queries"] == sum(len(p) for r in rounds for p in r)
    usable = prefix_len // block_size * block_size
    assert stats["prefix_cache_hits"] >= 4 * usable  # two prompts in each later round
    assert off.stats()["prefix_cache_hits"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_arriving_together_compute_the_prefix_once(
        checkpoints: dict[str, pathlib.Path], engines: list[LLM], family: str) -> None:
    # a step budget that takes all six prompts at once: without waiting they would all
    # compute the prefix in the first step
    on = make_llm(checkpoints[family], max_num_batched_tokens=256)
    off = make_llm(checkpoints[family], max_num_batched_tokens=256,
                   enable_prefix_caching=False)
    engines += [on, off]
    prefix = random_tokens(5 * W, seed=7)  # 30 tokens: 7 full blocks of 4
    prompts = [prefix + random_tokens(5, seed=i) for i in range(6)]
    assert run(on, prompts, 2 * W) == run(off, prompts, 2 * W)
    # The first computes the prefix; the other five wait for it and find 28 tokens cached.
    stats = on.stats()
    assert stats["prefix_cache_hits"] == 5 * 28
    assert stats["prompt_tokens"] == off.stats()["prompt_tokens"] - 5 * 28


@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_chat_turn_reuses_the_first_turns_prompt_and_answer(
        checkpoints: dict[str, pathlib.Path], engines: list[LLM], family: str) -> None:
    on = make_llm(checkpoints[family])
    off = make_llm(checkpoints[family], enable_prefix_caching=False)
    engines += [on, off]
    first = random_tokens(4 * W + 1, seed=3)
    answer = run(on, [first], 4 * W)[0]
    assert answer == run(off, [first], 4 * W)[0]
    second = first + answer + random_tokens(7, seed=4)
    before = on.stats()["prefix_cache_hits"]
    assert run(on, [second], 2 * W) == run(off, [second], 2 * W)
    # The first turn stored its prompt and all but its last answer token.
    stored = len(first) + len(answer) - 1
    assert on.stats()["prefix_cache_hits"] - before == stored // 4 * 4


@pytest.mark.parametrize("family", FAMILIES)
def test_eviction_under_a_small_pool_keeps_outputs_exact(
        checkpoints: dict[str, pathlib.Path], engines: list[LLM], family: str) -> None:
    on = make_llm(checkpoints[family], kv_cache_memory="48KiB", max_model_len=64)
    off = make_llm(checkpoints[family], kv_cache_memory="48KiB", max_model_len=64,
                   enable_prefix_caching=False)
    engines += [on, off]
    prompts = [random_tokens(20, seed=50 + i) for i in range(12)]
    for prompt in [*prompts, *prompts[:3], prompts[0][:12] + random_tokens(5, seed=99)]:
        assert run(on, [prompt], 20) == run(off, [prompt], 20)
    stats = on.stats()
    assert stats["prefix_cache_evictions"] > 0
    assert stats["prefix_cache_blocks"] <= stats["kv_blocks_total"]
