"""The model runner needs nothing but the step's plan (docs/design.md §4).

The planner is the only caller of the KV manager in a step; the runner holds no manager and
turns a `StepPlan` (plain lists) into tensors. Checked by replay: every plan of a run with
prefix caching, chunked prefill and ngram speculation (so ring entries take fresh blocks
and verification rows are planned twice) goes through pickle into a second runner that
shares nothing with the first but the weights, and gives the same logits, bit for bit.
"""

from __future__ import annotations

import pathlib
import pickle
from typing import Any

import pytest
import torch

from ringserve.block_manager import KVCacheManager
from ringserve.engine import LLMEngine, SamplingParams, spec_decode
from ringserve.engine.config import EngineConfig
from ringserve.engine.kv_cache import allocate_kv_caches, model_kv_sources
from ringserve.engine.model_runner import ModelRunner
from ringserve.engine.step_plan import StepPlan, TableUpdate
from tests.tiny_models import W, make_checkpoint, random_tokens


def _engine(path: pathlib.Path, **kwargs: Any) -> LLMEngine:
    options: dict[str, Any] = dict(model=str(path), dtype="float32", block_size=4,
                                   kv_cache_memory="4MiB", max_num_seqs=8,
                                   max_num_batched_tokens=8, max_model_len=256, debug_kv=True)
    return LLMEngine(EngineConfig(**{**options, **kwargs}))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"))


def test_the_runner_holds_no_kv_manager(ckpt: pathlib.Path) -> None:
    engine = _engine(ckpt)
    assert not [v for v in vars(engine.runner).values() if isinstance(v, KVCacheManager)]


def test_plans_replayed_in_another_runner_give_the_same_logits(
        ckpt: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec_decode.StepCost, "worth", lambda *_args: True)
    engine = _engine(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    recorded: list[tuple[bytes, Any, torch.Tensor]] = []
    execute = engine.runner.execute

    def record(plan: StepPlan, scheduled: Any) -> Any:
        wire = pickle.dumps(plan)  # taken before the step: what another process would get
        logits, prompt_logprobs = execute(plan, scheduled)
        recorded.append((wire, scheduled, logits.clone()))
        return logits, prompt_logprobs

    monkeypatch.setattr(engine.runner, "execute", record)
    motif = random_tokens(5, seed=5)
    prompts = [random_tokens(2 * W + 3, seed=7), motif * 4, random_tokens(9, seed=6) + motif * 3]
    params = SamplingParams(temperature=0.0, max_tokens=4 * W, ignore_eos=True)
    for _round in range(2):  # the second round hits the first one's cached prefixes
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{_round}-{i}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished:
            engine.step()
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    plans = [pickle.loads(wire) for wire, _, _ in recorded]
    assert any(len(u.blocks) > 1 and u.first == 0 and i > 0 for i, p in enumerate(plans)
               for u in p.updates)  # whole rows resent (fresh ring blocks), not only growth
    assert any(p.early_writes for p in plans)  # verification rows
    assert all(isinstance(u, TableUpdate) for p in plans for u in p.updates)

    # a second runner: fresh caches and tables, the same weights, nothing else shared
    spec = engine.kv.spec
    caches = allocate_kv_caches(spec, engine.kv.pool.num_blocks, engine.model.config.num_layers,
                                engine.kv_dtype, engine.device,
                                model_kv_sources(engine.model.config))
    for k, v in caches:
        k.fill_(float("nan"))  # a slot the plan does not write first is never read
        v.fill_(float("nan"))
    other = ModelRunner(engine.model, caches, windows=[g.window for g in spec.groups],
                        rings=list(engine.kv.ring_blocks), block_size=spec.block_size,
                        max_num_seqs=8, max_model_len=256, device=engine.device)
    for plan, (_, scheduled, logits) in zip(plans, recorded, strict=True):
        again, _ = other.execute(plan, scheduled)
        assert torch.equal(again, logits)
