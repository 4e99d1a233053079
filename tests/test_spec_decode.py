"""Speculative decoding by prompt lookup, exact on the ring.

Greedy outputs with speculation must be the outputs without it, token for token, on tiny
models of every layer mix, with the debug shadow checking every read of the ring; the
sampling rule must keep the distribution (a chi-square test); and a ring without the slack
shows the read miss a rejected draft causes.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import pytest
import torch

from ringserve.block_manager import KVCacheManager, KVCacheSpec, LayerGroup
from ringserve.engine import LLM, SamplingParams, spec_decode
from ringserve.engine.errors import InvalidRequestError
from ringserve.engine.sampler import Sampler
from ringserve.engine.sequence import Sequence
from ringserve.engine.spec_decode import SpeculativeConfig, propose
from tests.tiny_models import make_checkpoint, random_tokens


def test_propose_takes_the_longest_suffix_and_its_latest_occurrence() -> None:
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 3, 2, 4) == [4, 5, 1]
    # [3, 4, 1, 2] last occurred at 2 (a later [1, 2] alone would match a shorter suffix)
    assert propose([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 5, 2, 4) == [3, 4, 1, 2]
    assert propose([9, 8, 1, 2, 7, 1, 2, 6, 1, 2], 2, 2, 4) == [6, 1]  # the most recent
    assert propose([5, 6, 7], 3, 2, 4) == []
    assert propose([1, 2, 3, 1, 2, 3], 2, 4, 4) == []  # shorter than lookup_min: none


def test_speculative_config_is_checked_with_its_field() -> None:
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5}') == \
        SpeculativeConfig(num_speculative_tokens=5)
    for bad, field in [('{"method": "eagle"}', "method"),
                       ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}',
                        "prompt_lookup_max"),
                       ('{"draft_model": "x"}', ""), ("{nope", "")]:
        with pytest.raises(ValueError) as err:
            SpeculativeConfig.parse(bad)
        assert field in str(getattr(err.value, "param", ""))


# -- greedy: the same tokens --------------------------------------------------------------

FAMILIES = [
    ("mistral", 4),  # every layer slides, w = 6, b = 4: w % b != 0
    ("mistral", 3),  # w % b == 0
    ("gemma3_text", 4),  # sliding and full layers
    ("llama", 4),  # full attention only
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {family: make_checkpoint(family, root, eos=True)
            for family in {f for f, _ in FAMILIES}}


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (drafts find matches) and are longer than the ring."""
    motif = random_tokens(7, seed=1)
    return [motif * 5, random_tokens(40, seed=2) + motif * 3, random_tokens(5, seed=3),
            (random_tokens(3, seed=4) + motif) * 4]


def _run(path: pathlib.Path, block_size: int, params: list[SamplingParams],
         **kwargs: Any) -> tuple[list[list[int]], dict[str, Any]]:
    llm = LLM(str(path), dtype="float32", block_size=block_size, kv_cache_memory="4MiB",
              max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, debug_kv=True,
              **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
    stats = llm.stats()
    assert stats["kv_read_misses"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize(("family", "block_size"), FAMILIES)
@pytest.mark.parametrize(("k", "caching"), [(1, False), (3, False), (5, False), (3, True),
                                             (5, True)])
def test_greedy_is_the_same_with_and_without_speculation(
        checkpoints: dict[str, pathlib.Path], family: str, block_size: int, k: int,
        caching: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without prefix caching the rings hold exactly ``w + k`` (rounded up to blocks): a
    ring one draft shorter loses a position a later query reads (tried: these fail)."""
    # NOTE: every draft is tried here: whether one pays is learned from this machine's step
    # times (StepCost, tested on its own below), and on a busy machine it once refused them
    # all, which left nothing to verify
    monkeypatch.setattr(spec_decode.StepCost, "worth", lambda *_args: True)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (40, 33, 25, 48)]
    off, _ = _run(checkpoints[family], block_size, params, enable_prefix_caching=caching)
    on, stats = _run(checkpoints[family], block_size, params, enable_prefix_caching=caching,
                     speculative_config={"method": "ngram", "num_speculative_tokens": k})
    assert on == off
    assert stats["spec_decode_num_accepted_tokens"] > 0  # drafts were kept, not only tried
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]


def test_without_the_cost_gate_drafts_do_not_wait_for_it_to_say_they_pay(
        checkpoints: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """``"cost_gate": false`` drafts whatever the lookup finds; by default a step cost that
    says drafts never pay stops them all. The greedy text is the same either way."""
    monkeypatch.setattr(spec_decode.StepCost, "worth", lambda *_args: False)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 4
    runs = {gate: _run(checkpoints["mistral"], 4, params, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "cost_gate": gate})
        for gate in (True, False)}
    assert runs[True][1]["spec_decode_num_draft_tokens"] == 0
    assert runs[False][1]["spec_decode_num_accepted_tokens"] > 0
    assert runs[True][0] == runs[False][0]
    with pytest.raises(InvalidRequestError, match="cost_gate") as err:
        SpeculativeConfig.parse('{"method": "ngram", "cost_gate": "no"}')
    assert err.value.param == "speculative_config.cost_gate"


@pytest.mark.parametrize(("family", "block_size"), FAMILIES)
@pytest.mark.parametrize("caching", [False, True])
def test_drafts_rejected_at_every_position_change_nothing(
        checkpoints: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch, family: str,
        block_size: int, caching: bool) -> None:
    """An oracle proposer that knows the greedy continuation drafts its first ``j`` tokens
    right and the rest wrong, ``j`` cycling through 0..k: every draft position is kept
    and rejected in turn, so a rejected draft lands as far ahead as the slack allows.
    Outputs equal plain decoding, no read misses (a ring without the slack fails here)."""
    # NOTE: every draft is tried, as above (the learned step cost may refuse them on a busy
    # machine, and then no position is kept or rejected)
    monkeypatch.setattr(spec_decode.StepCost, "worth", lambda *_args: True)
    k = 5
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (40, 33, 25, 48)]
    off, _ = _run(checkpoints[family], block_size, params, enable_prefix_caching=caching)
    truth = {tuple(p): list(p) + out for p, out in zip(_prompts(), off, strict=True)}
    calls = [0]

    def oracle(tokens: list[int], n: int, lookup_min: int, lookup_max: int) -> list[int]:
        full = next(t for p, t in truth.items() if list(p) == tokens[: len(p)])
        right = full[len(tokens) : len(tokens) + n]
        calls[0] += 1
        j = calls[0] % (n + 1)
        return right[:j] + [(t + 1) % 300 + 3 for t in right[j:]]

    spec = {"method": "ngram", "num_speculative_tokens": k}
    monkeypatch.setattr(spec_decode, "propose", lambda *args: [])
    _, same_rings = _run(checkpoints[family], block_size, params,
                         enable_prefix_caching=caching, speculative_config=spec)
    monkeypatch.setattr(spec_decode, "propose", oracle)
    on, stats = _run(checkpoints[family], block_size, params, enable_prefix_caching=caching,
                     speculative_config=spec)
    assert on == off
    # the ring's counters roll back with the sequence: the same as decoding one token at a
    # time on rings of the same length
    for counter in ("ring_block_recycles", "ring_slot_overwrites"):
        assert stats[counter] == same_rings[counter], counter
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert all(stats["spec_decode_num_accepted_tokens_per_pos"])  # kept at every position


@pytest.mark.parametrize("caching", [True, False])
def test_stops_inside_an_accepted_run_cut_exactly_there(
        checkpoints: dict[str, pathlib.Path], caching: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """max_tokens, end-of-sequence and stop strings that fall inside a run of kept drafts
    end the output where decoding one token at a time ends it."""
    # NOTE: every draft is tried, as above: during a full `make test` on a busy machine the
    # learned step cost once refused them all, and nothing was kept to cut inside
    monkeypatch.setattr(spec_decode.StepCost, "worth", lambda *_args: True)
    path = checkpoints["gemma3_text"]
    free, _ = _run(path, 4, [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
                   * 4, enable_prefix_caching=caching)
    params = []
    for i, tokens in enumerate(free):
        cut = 7 + 3 * i
        params.append(SamplingParams(temperature=0.0, max_tokens=cut, ignore_eos=True)
                      if i % 2 else
                      SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                     stop_token_ids=[tokens[cut]]))
    spec = {"method": "ngram", "num_speculative_tokens": 5}
    off, _ = _run(path, 4, params, enable_prefix_caching=caching)
    on, stats = _run(path, 4, params, speculative_config=spec,
                     enable_prefix_caching=caching)
    assert on == off and stats["spec_decode_num_accepted_tokens"] > 0
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="4MiB",
              max_model_len=256, debug_kv=True, speculative_config=spec,
              enable_prefix_caching=caching)
    ref = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="4MiB",
              max_model_len=256, debug_kv=True, enable_prefix_caching=caching)
    prompt = {"prompt_token_ids": _prompts()[0]}
    text = ref.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                               ignore_eos=True))[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        stopped = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop])
        assert (llm.generate(prompt, stopped)[0].outputs[0].text
                == ref.generate(prompt, stopped)[0].outputs[0].text)


# -- sampling: the same distribution ------------------------------------------------------

CHI2_999 = {4: 18.47, 5: 20.52}  # chi-square critical values at p = 0.001


def test_the_rejection_rule_keeps_the_distribution() -> None:
    """Counts of the first and second emitted tokens over 20,000 seeded runs against the
    model's distribution: p for the first; for the second, p2 after a kept draft (the
    only case where a second token comes out of this step)."""
    vocab = 5
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0],
                           [0.0, 1.5, -0.5, 1.0, 0.2],
                           [1.0, 1.0, 1.0, 1.0, 1.0]])
    draft = (1, 3)
    p = torch.softmax(logits, dim=-1)
    n = 20_000
    sampler = Sampler()
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for i in range(n):
        seq = Sequence(seq_id=i, request_id="r", index=0, token_ids=[0], num_prompt_tokens=1,
                       params=SamplingParams(temperature=1.0, seed=i), max_tokens=8,
                       detokenizer=None)
        tokens, _ = sampler.verify(logits, seq, draft)
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
        sampler.forget(i)
    assert _chi2(first, p[0]) < CHI2_999[vocab - 1]
    assert _chi2(second, p[1]) < CHI2_999[vocab - 1]
    # seeded runs repeat
    seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=[0], num_prompt_tokens=1,
                   params=SamplingParams(temperature=1.0, seed=7), max_tokens=8,
                   detokenizer=None)
    once = Sampler().verify(logits, seq, draft)[0]
    assert all(Sampler().verify(logits, seq, draft)[0] == once for _ in range(5))


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# -- the ring's slack ----------------------------------------------------------------------


def test_a_rejected_draft_needs_the_slack() -> None:
    """b = 2, w = 4, k = 2, one sliding group.

    Without slack: R = 2 blocks, C = 4 slots. The sequence holds positions 0..5 (6 and on to
    come); a step verifies position 6 and drafts 7, 8. Draft 8 lands in slot 8 - C = 4 -> the
    slot of position 4. Both drafts are rejected: the sequence keeps 0..6. The next query, at
    position 7, reads 4..6 (w = 4): position 4 is gone, and the shadow says so.

    With slack k: R = ceil((4 + 2) / 2) = 3, C = 6: draft 8 lands on position 2's slot,
    which no query from 7 on reads.
    """
    def manager(slack: int, k: int) -> KVCacheManager:
        spec = KVCacheSpec(block_size=2, dtype_bytes=2, ring_slack=slack,
                           groups=(LayerGroup(name="s", window=4, layer_ids=(0,), num_kv_heads=1,
                                              head_dim=4),))
        return KVCacheManager(spec, 8, max_model_len=64, debug=True, speculative_tokens=k)

    tight = manager(slack=0, k=0)
    tight.admit("s", 6, 10)
    tight.append("s", 6)
    assert tight.check_reads("s", 6) == 0
    tight.append("s", 3)  # 6 and the drafts 7, 8 (this manager has no notion of drafts)
    tight.accept("s", 7)  # both rejected
    assert tight.check_reads("s", 7) == 1  # position 4: overwritten by draft 8

    roomy = manager(slack=2, k=2)
    roomy.admit("s", 6, 10)
    roomy.append("s", 6)
    roomy.append("s", 3, drafts=2)
    roomy.accept("s", 7)
    assert roomy.check_reads("s", 7) == 0
    assert roomy.ring_blocks == [3]
    with pytest.raises(ValueError, match="slack"):
        manager(slack=1, k=2)


def test_the_capacity_statement_counts_the_larger_rings(
        checkpoints: dict[str, pathlib.Path]) -> None:
    base = LLM(str(checkpoints["mistral"]), dtype="float32", block_size=4,
               kv_cache_memory="4MiB", max_model_len=256, enable_prefix_caching=False)
    spec = LLM(str(checkpoints["mistral"]), dtype="float32", block_size=4,
               kv_cache_memory="4MiB", max_model_len=256, enable_prefix_caching=False,
               speculative_config={"num_speculative_tokens": 5})
    assert base.engine.kv.ring_blocks[0] == math.ceil(6 / 4)
    assert spec.engine.kv.ring_blocks[0] == math.ceil((6 + 5) / 4)
    assert spec.stats()["max_concurrent_sequences"] < base.stats()["max_concurrent_sequences"]


def test_the_server_flag_and_metrics(checkpoints: dict[str, pathlib.Path],
                                     tmp_path: pathlib.Path) -> None:
    """`ringserve serve --speculative-config JSON`: the same greedy text as plain decoding,
    and vLLM's spec_decode counters on /metrics."""
    import openai

    from tests.server_utils import run_server

    path = checkpoints["gemma3_text"]
    prompts = _prompts()
    ref = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="4MiB",
              max_model_len=256)
    expected = [o.outputs[0].text for o in ref.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))]
    flags = ("--dtype", "float32", "--block-size", "4", "--kv-cache-memory", "4MiB",
             "--max-model-len", "256", "--debug-kv", "--speculative-config",
             # NOTE: no cost gate: its estimate comes from measured step times, and on a
             # busy CI machine it once refused every draft (0 accepted, the text right)
             '{"method": "ngram", "num_speculative_tokens": 4, "cost_gate": false}')
    with run_server(path, *flags, "--served-model-name", "tiny", log_dir=tmp_path) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt=prompts, max_tokens=30,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        stats = s.stats()
    assert [c.text for c in out.choices] == expected
    assert stats["spec_decode_num_accepted_tokens_total"] > 0, stats
    assert stats["spec_decode_num_draft_tokens_total"] >= \
        stats["spec_decode_num_accepted_tokens_total"]
    assert stats["kv_read_misses_total"] == 0


def test_back_off_after_drafts_keep_failing() -> None:
    seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=[1], num_prompt_tokens=1,
                   params=SamplingParams(), max_tokens=8, detokenizer=None)
    waits = []
    for _ in range(8):
        spec_decode.back_off(seq, 0, 3)
        waits.append(seq.spec_wait)
        seq.spec_wait = 0
    assert waits == [0, 1, 2, 4, 8, 16, 16, 16]
    spec_decode.back_off(seq, 2, 3)  # one kept draft starts over
    spec_decode.back_off(seq, 0, 3)
    assert (seq.spec_misses, seq.spec_wait) == (1, 0)


def test_step_cost_learns_what_a_token_and_a_verification_row_cost() -> None:
    cost = spec_decode.StepCost()
    assert cost.worth(0.01, 8, 5)  # nothing learned yet: try
    for tokens, rows in [(8, 0), (48, 8), (20, 3), (8, 0), (33, 5), (8, 1), (40, 6),
                         (12, 0), (200, 0)] * 3:
        cost.observe(tokens, rows, 0.0145 + 0.0034 * tokens + 0.0035 * rows)
    fitted = cost.fit()
    assert fitted is not None
    assert all(abs(x - y) < 1e-6 for x, y in zip(fitted, (0.0145, 0.0034, 0.0035),
                                                 strict=True))
    # one decode: a token costs 17.9 ms plainly; 5 drafts cost 3.5 + 17 ms
    assert cost.worth(0.3, 1, 5) and not cost.worth(0.2, 1, 5)
    # eight decodes: 5.2 ms a token plainly: 5 drafts pay only when most are kept
    assert cost.worth(0.9, 8, 5) and not cost.worth(0.7, 8, 5)
