"""Arriving prompts keep running streams' TPOT (`--max-prefill-slowdown`).

While sequences decode, a step's prompt chunks take only the tokens that keep its predicted
time within the slowdown times a decode-only step's (`engine.prefill_cost`: both learned
from the machine's own steps); a probe of a few blocks while a chunk's cost is unknown; at
least one block a step. Checked on the cost model with known step times, on the scheduler
with a known cost, and through the engine: the same tokens as uncapped, chunks as the rule
says.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from ringserve.block_manager import KVCacheManager, KVCacheSpec, group_layers
from ringserve.engine import LLM, SamplingParams
from ringserve.engine.prefill_cost import DECODE_REFRESH, PrefillCost
from ringserve.engine.scheduler import PROBE_BLOCKS, Scheduler
from ringserve.engine.sequence import Sequence
from tests.tiny_models import make_checkpoint, random_tokens

# a decode-only step: 10 ms (whatever its batch: memory-bound); a chunk: 2 ms + 1 ms a token
# + 1 ms a token per 1000 positions of context it reads
A, Q, P, R = 0.010, 0.002, 0.001, 0.001


def _step_time(chunks: list[tuple[int, int]]) -> float:
    return A + sum(Q + P * n + R * n * c / 1000 for n, c in chunks)


def _learned() -> PrefillCost:
    cost = PrefillCost()
    for decodes, chunks in [(4, []), (8, []), (2, []), (6, []), (8, [(40, 0)]),
                            (8, [(9, 300)]), (4, [(64, 100), (16, 0)]), (8, [(17, 900)]),
                            (3, [(30, 500)]), (8, [(50, 50)])] * 2:
        cost.observe(decodes, chunks, _step_time(chunks))
    return cost


def test_the_cost_of_decodes_and_of_chunks_is_learned_apart() -> None:
    cost = PrefillCost()
    assert cost.decode_time(8) is None and cost.chunk_tokens(1.0, 0) is None
    cost.observe(8, [], A)
    cost.observe(8, [(40, 0)], _step_time([(40, 0)]))  # no decode time yet: not used
    assert cost.chunks.solve() is None
    cost = _learned()
    assert abs((cost.decode_time(8) or 0) - A) < 1e-9
    assert abs(cost.chunk_seconds(40, 500) - (Q + P * 40 + R * 40 * 0.5)) < 1e-9
    assert cost.chunk_tokens(0.0145, 500) == 8  # (14.5 - 2) / (1 + 0.5)
    assert cost.chunk_tokens(0.001, 0) == 0  # not even a chunk's fixed cost


def test_the_decode_time_follows_recent_decode_only_steps() -> None:
    cost = PrefillCost()
    for _ in range(4):
        cost.observe(8, [], 0.048)  # a cold first few
    assert cost.decode_time(8) is None  # not enough seen yet
    for _ in range(40):
        cost.observe(8, [], A)
    assert abs((cost.decode_time(8) or 0) - A) < 1e-4


def _scheduler(slowdown: float | None, block_size: int = 4) -> Scheduler:
    spec = KVCacheSpec(block_size=block_size, dtype_bytes=4,
                       groups=group_layers([None], num_kv_heads=1, head_dim=8))
    kv = KVCacheManager(spec, 4096, max_model_len=1024)
    return Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=512,
                     max_prefill_slowdown=slowdown)


def _seq(i: int, prompt: int) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", index=0,
                    token_ids=random_tokens(prompt, seed=i), num_prompt_tokens=prompt,
                    params=SamplingParams(max_tokens=64), max_tokens=64, detokenizer=None)


def _schedule(sched: Scheduler, decodes: int, prompt: int) -> dict[str, int]:
    """One step with ``decodes`` decoding sequences and a waiting ``prompt``-token one."""
    for i in range(decodes):
        sched.add(_seq(i, 8))
    for item in sched.schedule().scheduled:  # their prompts, then each decodes a token
        item.seq.num_computed += item.num_new
        item.seq.token_ids.append(5)
    sched.add(_seq(100, prompt))
    return {s.seq.request_id: s.num_new for s in sched.schedule().scheduled}


@pytest.mark.parametrize(("slowdown", "decodes", "expected"), [
    (2.0, 4, 8),     # ((2 - 1) * 10 - 2) / 1: 10 ms more, 2 of them the chunk's own
    (1.5, 8, 3),     # 0.5 * 10 - 2
    (3.0, 2, 18),    # 2 * 10 - 2
    (1.01, 2, 4),    # not even the chunk's fixed cost fits: one block still
    (None, 4, 300),  # no cap: the whole prompt
    (2.0, 0, 300),   # nothing decodes: nothing to protect
])
def test_the_prefill_chunk_keeps_the_step_within_the_slowdown(
        slowdown: float | None, decodes: int, expected: int) -> None:
    sched = _scheduler(slowdown)
    sched.prefill_cost = _learned()
    got = _schedule(sched, decodes, 300)
    assert got["r100"] == expected
    assert all(got[f"r{i}"] == 1 for i in range(decodes))


def test_before_a_chunks_cost_is_known_a_first_chunk_probes_it() -> None:
    sched = _scheduler(2.0)
    for _ in range(6):
        sched.prefill_cost.observe(4, [], A)
    assert _schedule(sched, 4, 300)["r100"] == PROBE_BLOCKS * 4


def test_a_decode_only_step_measures_what_the_share_is_relative_to() -> None:
    sched = _scheduler(2.0)  # nothing learned: the step feeds the decodes alone
    assert "r100" not in _schedule(sched, 4, 300)
    sched = _scheduler(2.0)
    sched.prefill_cost = _learned()
    sched.prefill_cost.since_decode_only = DECODE_REFRESH  # a steady stream of prompts
    assert "r100" not in _schedule(sched, 4, 300)
    sched.prefill_cost.observe(5, [], A)  # that step, measured
    assert not sched.prefill_cost.wants_decode_step()


class _Known(PrefillCost):
    """The learned cost, deaf to this machine's step times (the test is about the rule)."""

    def __init__(self) -> None:
        learned = _learned()
        super().__init__()
        self.decode, self.chunks = learned.decode, learned.chunks

    def observe(self, *_args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"))


def test_the_engine_gives_the_same_tokens_with_capped_chunks(
        ckpt: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options: dict[str, Any] = dict(dtype="float32", block_size=4, kv_cache_memory="4MiB",
                                   max_num_seqs=8, max_num_batched_tokens=64,
                                   max_model_len=256, debug_kv=True)
    prompts = [{"prompt_token_ids": random_tokens(n, seed=n)} for n in (5, 7, 90, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [list(o.outputs[0].token_ids)
             for o in LLM(str(ckpt), **options).generate(prompts, params)]
    llm = LLM(str(ckpt), max_prefill_slowdown=1.5, **options)
    engine = llm.engine
    engine.scheduler.prefill_cost = _Known()
    steps: list[tuple[int, list[tuple[int, int]]]] = []  # per step: decode tokens, chunks
    schedule = engine.scheduler.schedule

    def recorded() -> Any:
        out = schedule()
        chunks = [(s.num_new, s.seq.num_computed) for s in out.scheduled if s.seq.is_prefilling]
        steps.append((sum(s.num_new for s in out.scheduled) - sum(n for n, _ in chunks), chunks))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recorded)
    # the two short prompts first, so that the long ones arrive while they decode
    requests = [engine.add_request("a", prompts[0], params),
                engine.add_request("b", prompts[1], params)]
    engine.step()
    requests += [engine.add_request("c", prompts[2], params),
                 engine.add_request("d", prompts[3], params)]
    while engine.has_unfinished:
        engine.step()
    assert [list(r.seqs[0].output_token_ids) for r in requests] == plain
    capped = [(d, c) for d, c in steps if d and c]
    assert len(capped) >= 10  # the long prompts came in while others decoded
    for _decode_tokens, chunks in capped:
        extra = sum(Q + P * n + R * n * c / 1000 for n, c in chunks)
        assert extra <= 0.5 * A + 1e-9 or sum(n for n, _ in chunks) <= 4
    assert max(sum(n for n, _ in c) for d, c in steps if not d) > 7  # alone: whole chunks
