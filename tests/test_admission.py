"""The admission answer (issue 26): what `GET /v1/admission` and the admission gauges say
equals what admission then does.

- Randomized (hypothesis) over pool sizes, layer windows, block sizes, running sets (some
  blocks already used) and waiting queues: the answer for a shape is checked by admitting
  through the real `KVCacheManager`, first the waiting sequences in order, then requests of
  the shape until one does not fit, with the scheduler's running-slot limit.
- Through the engine: `fit_now` requests of the shape sent at once all run after one step,
  one more waits.
- Over HTTP: the route's answer and the gauges of ``--admission-shapes`` agree, and bad
  parameters are named.
"""

from __future__ import annotations

import pathlib

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.block_manager import KVCacheManager, KVCacheSpec, admission, group_layers
from ringserve.block_manager.budget import sequences_that_fit
from ringserve.engine import LLMEngine, SamplingParams
from ringserve.engine.config import EngineConfig
from tests.server_utils import run_server
from tests.tiny_models import make_checkpoint, random_tokens

shapes = st.tuples(st.integers(1, 30), st.integers(1, 30))


@settings(max_examples=300, deadline=None)
@given(block_size=st.integers(1, 6),
       layer_windows=st.lists(st.one_of(st.none(), st.integers(1, 20)), min_size=1,
                              max_size=5),
       pool=st.integers(0, 150), running=st.lists(st.tuples(shapes, st.integers(0, 40)),
                                                  max_size=6),
       waiting=st.lists(shapes, max_size=4), shape=shapes, max_running=st.integers(1, 12))
def test_the_answer_is_what_admission_does(block_size: int, layer_windows: list[int | None],
                                           pool: int, running: list[tuple[tuple[int, int], int]],
                                           waiting: list[tuple[int, int]],
                                           shape: tuple[int, int], max_running: int) -> None:
    spec = KVCacheSpec(block_size=block_size, dtype_bytes=2,
                       groups=group_layers(layer_windows, num_kv_heads=1, head_dim=4))
    kv = KVCacheManager(spec, pool, max_model_len=100, enable_prefix_caching=False)
    admitted = 0
    for i, ((p, m), steps) in enumerate(running):  # a running set, partly computed
        if admitted < max_running and kv.can_admit(p, m):
            kv.admit(("run", i), p, m)
            kv.append(("run", i), min(p + m, max(1, steps)))
            admitted += 1
    waiting = [(p, m) for p, m in waiting if sum(kv.reservation(p, m)) <= pool]
    state = kv.admission_state(waiting, admitted, max_running)
    answer = admission(spec, state, *shape)
    # now admit as the scheduler would: the queue first, then the new shape
    slots, blocked = max_running - admitted, False
    for i, (p, m) in enumerate(waiting):
        if slots < 1 or not kv.can_admit(p, m):
            blocked = True
            break
        kv.admit(("wait", i), p, m)
        slots -= 1
    count = 0
    while not blocked and slots > 0 and kv.can_admit(*shape):
        kv.admit(("new", count), *shape)
        count, slots = count + 1, slots - 1
    assert answer.fit_now == count
    assert answer.admit_now == (not waiting and count >= 1)
    assert answer.fit_empty == min(sequences_that_fit(spec, pool, sum(shape)), max_running)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"))


def test_sending_fit_now_requests_runs_them_all(ckpt: pathlib.Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4,
                                    kv_cache_memory="256KiB", max_num_seqs=32,
                                    max_num_batched_tokens=2048, max_model_len=128))
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(3):  # something running, holding blocks
        engine.add_request(f"bg{i}", {"prompt_token_ids": random_tokens(20, i)}, long)
    engine.step()
    prompt, out = 12, 40
    answer = admission(engine.kv.spec, engine.stats()["admission_state"], prompt, out)
    assert answer.running == 3 and answer.admit_now and 1 <= answer.fit_now < 32
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    for i in range(answer.fit_now + 1):
        engine.add_request(f"new{i}", {"prompt_token_ids": random_tokens(prompt, 10 + i)},
                           params)
    engine.step()
    assert len(engine.scheduler.running) == 3 + answer.fit_now
    assert len(engine.scheduler.waiting) == 1  # the one past the answer waits
    after = admission(engine.kv.spec, engine.stats()["admission_state"], prompt, out)
    assert after.fit_now == 0 and not after.admit_now


def test_the_route_and_the_gauges(ckpt: pathlib.Path, tmp_path: pathlib.Path) -> None:
    flags = ("--dtype", "float32", "--block-size", "4", "--kv-cache-memory", "256KiB",
             "--max-model-len", "128", "--admission-shapes", "12:40,100:28")
    with run_server(ckpt, *flags, log_dir=tmp_path) as s:
        body = httpx.get(s.url + "/v1/admission",
                         params={"prompt_tokens": 12, "max_tokens": 40}).json()
        assert body["admit_now"] is True and body["sequences_running"] == 0
        assert body["fit_now"] == body["fit_empty"] >= 1
        assert sum(g["blocks_per_request"] for g in body["groups"]) * body["fit_empty"] <= \
            body["blocks_total"]
        metrics = httpx.get(s.url + "/metrics").text
        line = next(x for x in metrics.splitlines() if x.startswith(
            "ringserve:admission_fit_now{") and 'prompt_tokens="12"' in x)
        assert float(line.rsplit(" ", 1)[1]) == body["fit_now"]
        for params, param in [({"prompt_tokens": 0, "max_tokens": 5}, "prompt_tokens"),
                              ({"prompt_tokens": 5}, "max_tokens"),
                              ({"prompt_tokens": 100, "max_tokens": 100}, "max_tokens")]:
            r = httpx.get(s.url + "/v1/admission", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
