"""The engine end to end on tiny checkpoints: continuous batching, admission, sampling.

Every engine here runs with ``debug_kv=True``, so each read of the ring is checked against a
shadow of slot owners; every test ends by asserting no read missed, nothing was preempted
and every block went back to the pool.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ringserve.engine import LLM, InvalidRequestError, SamplingParams
from tests.tiny_models import B, W, hf_reference, make_checkpoint, random_tokens

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Mixed sliding (w=6) and full layers: 3 sliding layers and 1 full one, four layer
    groups of one layer each, drawing on one pool."""
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Every layer slides (w=6): a sequence's KV is bounded at one ring."""
    return make_checkpoint("mistral", tmp_path_factory.mktemp("ckpt"))


def make_llm(path: pathlib.Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(dtype="float32", block_size=B, kv_cache_memory="4MiB",
                                   max_num_seqs=8, max_num_batched_tokens=16, debug_kv=True,
                                   max_model_len=256)
    return LLM(str(path), **{**options, **kwargs})


@pytest.fixture
def check_clean() -> Iterator[list[LLM]]:
    """Register engines here; after the test each must be idle and have missed nothing."""
    engines: list[LLM] = []
    yield engines
    for llm in engines:
        stats = llm.stats()
        assert stats["kv_read_misses"] == 0
        assert stats["num_preemptions"] == 0
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0


def hf_greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
    return list(out[0, len(prompt):].tolist())


def test_32_mixed_requests_match_alone_and_transformers(
        gemma: pathlib.Path, check_clean: list[LLM]) -> None:
    rng = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 4 * W, (32,), generator=rng).tolist()  # some longer than C=8
    outputs = torch.randint(1, 8 * W + 1, (32,), generator=rng).tolist()
    outputs[:4] = [8 * W] * 4
    prompts = [random_tokens(n, seed=i) for i, n in enumerate(lengths)]
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in outputs]
    llm = make_llm(gemma)
    check_clean.append(llm)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ref = hf_reference(gemma)
    for prompt, param, out in zip(prompts, params, batched, strict=True):
        got = out.outputs[0].token_ids
        assert len(got) == param.max_tokens and out.outputs[0].finish_reason == "length"
        assert got == hf_greedy(ref, prompt, param.max_tokens)
    for prompt, param, out in list(zip(prompts, params, batched, strict=True))[:8]:
        alone = llm.generate({"prompt_token_ids": prompt}, param)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    stats = llm.stats()
    assert stats["ring_block_recycles"] > 0 and stats["ring_slot_overwrites"] > 0


def test_pool_of_exactly_k_rings_admits_k_and_the_next_waits(
        mistral: pathlib.Path, check_clean: list[LLM]) -> None:
    k = 3
    probe = make_llm(mistral)
    spec = probe.engine.kv.spec
    ring_bytes = spec.pool_blocks_needed(10**9) * spec.block_bytes  # all its rings
    llm = make_llm(mistral, kv_cache_memory=k * ring_bytes)
    check_clean += [probe, llm]
    assert llm.stats()["max_concurrent_sequences"] == k
    engine = llm.engine
    params = SamplingParams(max_tokens=4 * W, **GREEDY)
    requests = [engine.add_request(str(i), random_tokens(5, seed=i), params)
                for i in range(k + 1)]
    engine.step()
    assert llm.stats()["num_requests_running"] == k
    assert llm.stats()["num_requests_waiting"] == 1
    while not requests[0].finished:
        assert requests[k].seqs[0].num_computed == 0  # still waiting, never squeezed in
        engine.step()
    engine.step()
    assert requests[k].seqs[0].num_computed > 0  # admitted once a ring came free
    while engine.has_unfinished:
        engine.step()
    assert all(r.finished for r in requests)


def test_short_requests_fill_what_the_bytes_allow_across_all_layers(
        gemma: pathlib.Path, check_clean: list[LLM]) -> None:
    # The tiny gemma3: 4 layers (3 sliding with w=6, 1 full), 2 KV heads x 16 dims, float32:
    # 256 bytes of K and V per token and layer, counted here from the config alone.
    cfg = json.loads((gemma / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    per_token_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    memory = 330 * 2**10
    llm = make_llm(gemma, kv_cache_memory=memory, max_num_seqs=256,
                   max_num_batched_tokens=1024, max_model_len=256)
    check_clean.append(llm)
    engine = llm.engine
    prompt, new = 3, 3  # 6 tokens a request, under the window: every layer holds them all
    requests = [engine.add_request(str(i), random_tokens(prompt, seed=i),
                                   SamplingParams(max_tokens=new, **GREEDY))
                for i in range(80)]
    exact = (prompt + new) * layers * per_token_layer
    allow = memory // exact
    # one block of B tokens per layer may go to rounding (a block per group)
    floor = memory // (exact + B * layers * per_token_layer)
    peak = 0
    while engine.has_unfinished:
        engine.step()
        running = llm.stats()["num_requests_running"]
        peak = max(peak, running)
        assert running <= allow
    assert floor <= peak <= allow, (floor, peak, allow)
    assert peak == engine.kv.sequences_that_fit(prompt + new)
    assert all(r.finished for r in requests)


def test_a_long_request_still_holds_only_its_rings_in_sliding_groups(
        gemma: pathlib.Path, check_clean: list[LLM]) -> None:
    llm = make_llm(gemma)
    check_clean.append(llm)
    engine = llm.engine
    n = 5 + 20 * W
    request = engine.add_request("long", random_tokens(5, seed=1),
                                 SamplingParams(max_tokens=20 * W, **GREEDY))
    ring = engine.kv.spec.ring_blocks(0)  # ceil((W + B - 1) / B): prefix caching's slack
    assert ring == -(-(W + B - 1) // B)
    windows = [g.window for g in engine.kv.spec.groups]
    assert windows.count(W) == 3 and windows.count(None) == 1
    reserved = llm.stats()["kv_blocks_reserved"]
    engine.step()
    assert llm.stats()["kv_blocks_reserved"] - reserved == 3 * ring + -(-n // B)
    seq_id = request.seqs[0].seq_id
    while not request.finished:
        rows = engine.kv.block_tables(seq_id)
        length = engine.kv.num_tokens(seq_id)
        for w, row in zip(windows, rows, strict=True):
            assert len(row) == (min(-(-length // B), ring) if w else -(-length // B))
        engine.step()
    # the last token is sampled but never fed back, so n - 1 positions were stored
    assert request.seqs[0].blocks_held == 3 * ring + -(-(n - 1) // B)


def test_request_that_can_never_fit_is_refused_with_numbers(
        gemma: pathlib.Path, check_clean: list[LLM]) -> None:
    llm = make_llm(gemma, kv_cache_memory="64KiB", max_model_len=200)
    check_clean.append(llm)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=191, **GREEDY))
    message = str(err.value)
    assert err.value.param == "max_tokens"
    assert "= 201 exceeds max_model_len 200" in message and "1 of 200 tokens" in message
    with pytest.raises(InvalidRequestError) as err:
        llm.generate({"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=1, **GREEDY))
    assert err.value.param == "prompt"
    assert llm.stats()["requests_rejected"] == 2
    # What fits is served, and refusals did not leak blocks (check_clean).
    out = llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=190, **GREEDY))
    assert len(out[0].outputs[0].token_ids) == 190


def test_a_prompt_that_is_not_unicode_text_is_refused(gemma: pathlib.Path,
                                                      check_clean: list[LLM]) -> None:
    """A lone UTF-16 surrogate (what JSON's "\\ud800" parses to) is no text a tokenizer
    takes: the offline API refuses it naming the prompt, as the server does."""
    llm = make_llm(gemma)
    check_clean.append(llm)
    for prompt in ("abc\ud800", {"prompt": "\udfff"}):
        with pytest.raises(InvalidRequestError) as err:
            llm.generate(prompt, SamplingParams(max_tokens=2, **GREEDY))
        assert err.value.param == "prompt" and "index" in str(err.value)
    out = llm.generate("abc\U0001F600", SamplingParams(max_tokens=2, **GREEDY))  # a pair is fine
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_pool_smaller_than_one_sequence_fails_at_start(mistral: pathlib.Path) -> None:
    # An all-sliding model needs one ring however long it runs; less than that serves no one.
    with pytest.raises(InvalidRequestError) as err:
        make_llm(mistral, kv_cache_memory=1024)
    assert err.value.param == "kv_cache_memory" and "cannot hold one sequence" in str(err.value)


def test_abort_frees_blocks_at_once(gemma: pathlib.Path, check_clean: list[LLM]) -> None:
    llm = make_llm(gemma)
    check_clean.append(llm)
    engine = llm.engine
    engine.add_request("a", random_tokens(20, seed=1), SamplingParams(max_tokens=100, **GREEDY))
    engine.add_request("b", random_tokens(9, seed=2), SamplingParams(max_tokens=20, **GREEDY))
    for _ in range(4):
        engine.step()
    assert llm.stats()["kv_blocks_used"] > 0
    request = engine.abort_request("a")
    assert request is not None and request.output().outputs[0].finish_reason == "abort"
    assert "a" not in engine.requests
    while engine.has_unfinished:
        engine.step()
    assert llm.stats()["request_success_abort"] == 1


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(
        mistral: pathlib.Path, check_clean: list[LLM]) -> None:
    llm = make_llm(mistral)
    check_clean.append(llm)
    prompt = {"prompt_token_ids": random_tokens(7, seed=3)}

    def run(**kw: Any) -> list[int]:
        params = SamplingParams(max_tokens=30, ignore_eos=True, **kw)
        return llm.generate(prompt, params)[0].outputs[0].token_ids

    first, again = run(temperature=1.0, seed=42), run(temperature=1.0, seed=42)
    assert first == again
    assert run(temperature=1.0, seed=43) != first
    assert run(temperature=1.3, top_k=1) == run(temperature=0.0)
    assert run(temperature=0.8, top_p=1e-6, seed=1) == run(temperature=0.0)


def test_n_returns_n_different_samples(mistral: pathlib.Path, check_clean: list[LLM]) -> None:
    llm = make_llm(mistral)
    check_clean.append(llm)
    out = llm.generate({"prompt_token_ids": [4, 5, 6]},
                       SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=7,
                                      ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3


def test_stop_string_cuts_the_text_exactly(mistral: pathlib.Path,
                                           check_clean: list[LLM]) -> None:
    llm = make_llm(mistral)
    check_clean.append(llm)
    prompt = "Once upon a time"
    full = llm.generate(prompt, SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0]
    text = full.text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip())
    cut = llm.generate(prompt, SamplingParams(max_tokens=40, stop=[stop], **GREEDY))
    out = cut[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    tokenizer = llm.tokenizer
    assert tokenizer.decode(full.token_ids) == text  # streamed pieces add up to the decode


def test_eos_and_stop_token_ids_end_generation(tmp_path: pathlib.Path,
                                               check_clean: list[LLM]) -> None:
    path = make_checkpoint("llama", tmp_path, eos=True)
    llm = make_llm(path)
    check_clean.append(llm)
    prompt = {"prompt_token_ids": random_tokens(5, seed=9)}
    free = llm.generate(prompt, SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    stop_id = free.token_ids[10]
    first = free.token_ids.index(stop_id)
    out = llm.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=[stop_id],
                                              **GREEDY))[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"), (dict(logprobs=99), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(top_k=-2), "top_k"),
])
def test_bad_sampling_params_name_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and param in str(err.value)


def test_logprobs_are_the_models_distribution(gemma: pathlib.Path,
                                              check_clean: list[LLM]) -> None:
    llm = make_llm(gemma)
    check_clean.append(llm)
    prompt = random_tokens(9, seed=4)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=3, logprobs=2, **GREEDY))[0].outputs[0]
    with torch.no_grad():
        logits = hf_reference(gemma)(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits, -1)
    first = out.logprobs[0]  # type: ignore[index]
    assert first.token_id == out.token_ids[0] == int(expected.argmax())
    assert abs(first.logprob - float(expected.max())) < 1e-4
    top_ids = [t for t, _ in first.top]
    assert top_ids == expected.topk(2).indices.tolist()
