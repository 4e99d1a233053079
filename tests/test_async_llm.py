"""The async front: the engine loop in its thread, streams per request, aborts, errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ringserve.engine import EngineConfig, EngineDeadError, LLMEngine, SamplingParams
from ringserve.engine.async_llm import AsyncLLM, StreamDelta
from tests.tiny_models import B, make_checkpoint, random_tokens

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    path = make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"))
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=B,
                                  kv_cache_memory="4MiB", max_num_seqs=8,
                                  max_num_batched_tokens=16, max_model_len=256, debug_kv=True))


@pytest.fixture
def front(engine: LLMEngine) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(engine)
    llm.start()
    yield llm
    llm.shutdown()
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_read_misses"] == 0
    assert stats["num_preemptions"] == 0


async def collect(front: AsyncLLM, prompt: Any, params: SamplingParams) -> list[StreamDelta]:
    return [d async for d in front.generate(prompt, params)]


def offline(engine: LLMEngine, prompt: Any, params: SamplingParams) -> Any:
    request = engine.add_request(f"offline-{time.monotonic_ns()}", prompt, params)
    while not request.finished:
        engine.step()
    return request.output()


def test_streams_add_up_to_the_offline_result(front: AsyncLLM, engine: LLMEngine) -> None:
    prompts = ["Once upon a time", "漢字とかな", "Emoji 🚀", {"prompt_token_ids": [7] * 12}]
    params = SamplingParams(max_tokens=24, **GREEDY)

    async def main() -> list[list[StreamDelta]]:
        return await asyncio.gather(*(collect(front, p, params) for p in prompts))

    streams = asyncio.run(main())
    front.shutdown()  # the engine is ours again for the offline runs
    for prompt, deltas in zip(prompts, streams, strict=True):
        assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
        expected = offline(engine, prompt, params).outputs[0]
        assert "".join(d.seqs[0].text for d in deltas) == expected.text
        assert [t for d in deltas for t in d.seqs[0].token_ids] == expected.token_ids
        assert deltas[-1].seqs[0].finish_reason == "length"
        assert deltas[-1].completion_tokens == 24


def test_a_consumer_that_leaves_aborts_its_request(front: AsyncLLM, engine: LLMEngine) -> None:
    async def main() -> None:
        stream = front.generate({"prompt_token_ids": random_tokens(20, 1)},
                                SamplingParams(max_tokens=200, **GREEDY))
        async for delta in stream:
            if delta.completion_tokens >= 3:
                break
        await stream.aclose()  # what a disconnecting HTTP client does
        for _ in range(200):
            if front.stats()["kv_blocks_used"] == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("blocks were not returned")

    asyncio.run(main())
    assert front.stats()["request_success_abort"] >= 1


def test_an_engine_error_fails_its_requests_and_the_loop_goes_on(
        front: AsyncLLM, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(plan: Any, scheduled: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected kernel failure")
        return real(plan, scheduled)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    params = SamplingParams(max_tokens=5, **GREEDY)

    async def main() -> list[StreamDelta]:
        with pytest.raises(RuntimeError, match="injected kernel failure"):
            await collect(front, "first", params)
        return await collect(front, "second", params)

    deltas = asyncio.run(main())
    assert deltas[-1].finished and deltas[-1].completion_tokens == 5
    assert front.dead is None


def test_bad_input_is_refused_before_queueing(front: AsyncLLM) -> None:
    from ringserve.engine import InvalidRequestError

    async def main() -> None:
        with pytest.raises(InvalidRequestError) as err:
            await collect(front, "", SamplingParams(max_tokens=5))
        assert err.value.param == "prompt"

    asyncio.run(main())
    assert front.num_waiting == 0


def test_shutdown_ends_open_streams_as_aborted(engine: LLMEngine) -> None:
    llm = AsyncLLM(engine)
    llm.start()

    async def main() -> None:
        stream = llm.generate({"prompt_token_ids": [5] * 4}, SamplingParams(max_tokens=200,
                                                                            **GREEDY))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        rest = [d async for d in stream]
        assert rest[-1].finished and rest[-1].seqs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            await collect(llm, "after shutdown", SamplingParams(max_tokens=2))

    asyncio.run(main())
    assert engine.stats()["kv_blocks_used"] == 0
