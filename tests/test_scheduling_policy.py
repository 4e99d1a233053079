"""``--scheduling-policy lpm``: the waiting prompt that finds the most cached goes first.

- Two prompts wait, a miss ahead of one whose prefix is cached: fcfs admits the miss first,
  lpm the hit; the tokens each request gets are the same either way (the order of
  admission changes no output: the engine with caching off is the reference).
- No starvation: behind a queue of hits, a miss is admitted after at most
  ``LPM_MAX_PASSES`` admissions pass it over.
"""

from __future__ import annotations

import pathlib

import pytest

from ringserve.engine import LLM, SamplingParams
from ringserve.engine.scheduler import LPM_MAX_PASSES
from tests.tiny_models import W, make_checkpoint, make_llm, random_tokens

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=W)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"))


def admission_order(llm: LLM, prompts: list[list[int]]) -> tuple[list[str], dict[str, list[int]]]:
    """Queue ``prompts`` (one running at a time) and step to the end: the order requests
    were admitted in, and each one's tokens."""
    engine = llm.engine
    requests = {f"r{i}": engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
                for i, p in enumerate(prompts)}
    order: list[str] = []
    while engine.has_unfinished:
        engine.step()
        for seq in engine.scheduler.running:
            if seq.request_id not in order:
                order.append(seq.request_id)
    return order, {k: list(r.seqs[0].output_token_ids) for k, r in requests.items()}


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_cached_prompt_first(ckpt: pathlib.Path, engines: list[LLM],
                                            policy: str) -> None:
    shared = random_tokens(6 * W, seed=1)
    reference = make_llm(ckpt, enable_prefix_caching=False, max_num_seqs=1)
    engines.append(reference)
    llm = make_llm(ckpt, max_num_seqs=1, scheduling_policy=policy)
    engines.append(llm)
    warm = [shared + random_tokens(3, seed=2)]
    admission_order(llm, warm)  # the shared prefix is now cached
    prompts = [random_tokens(6 * W, seed=3), shared + random_tokens(5, seed=4)]
    order, tokens = admission_order(llm, prompts)
    assert order == (["r0", "r1"] if policy == "fcfs" else ["r1", "r0"])
    assert tokens == admission_order(reference, prompts)[1]


def test_lpm_passes_a_miss_over_a_bounded_number_of_times(ckpt: pathlib.Path,
                                                          engines: list[LLM]) -> None:
    llm = make_llm(ckpt, max_num_seqs=1, scheduling_policy="lpm")
    engines.append(llm)
    shared = random_tokens(6 * W, seed=5)
    admission_order(llm, [[*shared, 7]])
    hits = [shared + random_tokens(2, seed=10 + i) for i in range(LPM_MAX_PASSES + 4)]
    order, _ = admission_order(llm, [random_tokens(6 * W, seed=6), *hits])
    assert order.index("r0") == LPM_MAX_PASSES  # passed over exactly that many times
