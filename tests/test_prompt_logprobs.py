"""prompt_logprobs (offline and on both endpoints) and echo + logprobs, against transformers.

The reference is transformers' own model on the same tiny checkpoint: the log-softmax, in
float32, of its logits over the whole prompt in one forward pass. Ours come from chunked
prefill (a few tokens a step), through sliding windows the prompts outgrow, with prefix
caching on.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer

from ringserve.engine import LLM, SamplingParams
from ringserve.engine import model_runner as runner_module
from tests.server_utils import Server, run_server
from tests.test_logits_processors import single_token_word
from tests.tiny_models import B, W, hf_reference, make_checkpoint, make_llm, random_tokens

GREEDY = dict(temperature=0.0, ignore_eos=True)
FAMILIES = ["gemma3_text", "mistral"]  # sliding and full layers; sliding only
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {family: make_checkpoint(family, root) for family in FAMILIES}


def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the model's distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_entry(entry: dict[int, Any], token: int, row: torch.Tensor, k: int,
                decode: Any) -> None:
    """One prompt position: ``entry`` maps token id -> (logprob, rank, decoded_token)."""
    value = float(row[token])
    # the actual token, its rank as vLLM counts it (tokens at least as likely), near-ties
    # either way
    got = entry[token]
    assert got.logprob == pytest.approx(value, abs=TOL)
    assert int((row > value + TOL).sum()) + 1 <= got.rank <= int((row >= value - TOL).sum())
    for t, e in entry.items():
        assert e.logprob == pytest.approx(float(row[t]), abs=TOL)
        assert e.decoded_token == decode([t])
    # the k likeliest, as transformers ranks them (up to near-ties), ranked 1..k; the actual
    # token is one of them or comes on top
    top = entry if len(entry) == k else {t: e for t, e in entry.items() if t != token}
    assert len(top) == k
    kth = float(row.topk(k).values[-1]) if k else float("inf")
    assert all(float(row[t]) >= kth - TOL for t in top)
    by_value = sorted(top.values(), key=lambda e: -e.logprob)
    assert [e.rank for e in by_value] == list(range(1, k + 1))


def check_prompt_logprobs(got: Any, prompt: list[int], ref: torch.Tensor, k: int,
                          decode: Any) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        check_entry(got[i], prompt[i], ref[i - 1], k, decode)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rows", [3, 64])  # logits reduced 3 positions at a time, or all
def test_prompt_logprobs_equal_transformers_over_chunks_and_windows(
        checkpoints: dict[str, pathlib.Path], engines: list[LLM], family: str, rows: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module, "PROMPT_LOGPROBS_ROWS", rows)
    path = checkpoints[family]
    llm = make_llm(path)  # 8 tokens a step: a prompt comes in several chunks
    engines.append(llm)
    ref = hf_reference(path)
    prompts = [random_tokens(4 * W + 3, seed=1), random_tokens(W + 1, seed=2),
               random_tokens(1, seed=3), random_tokens(3 * W, seed=4)]
    params = [SamplingParams(max_tokens=4, prompt_logprobs=5, **GREEDY),
              SamplingParams(max_tokens=4, prompt_logprobs=0, **GREEDY),
              SamplingParams(max_tokens=4, prompt_logprobs=2, **GREEDY),
              SamplingParams(max_tokens=4, **GREEDY)]  # batched beside one that asks none
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=4, **GREEDY))
    for prompt, param, out, alone in zip(prompts, params, outs, plain, strict=True):
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids  # sampling untouched
        if param.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        check_prompt_logprobs(out.prompt_logprobs, prompt, hf_logprobs(ref, prompt),
                              param.prompt_logprobs, llm.tokenizer.decode)
    assert outs[2].prompt_logprobs == [None]  # a one-token prompt


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cached_prompt_still_gets_every_prompt_logprob(
        checkpoints: dict[str, pathlib.Path], engines: list[LLM], family: str) -> None:
    path = checkpoints[family]
    llm = make_llm(path)
    engines.append(llm)
    prompt = random_tokens(5 * W + 2, seed=5)
    ref = hf_logprobs(hf_reference(path), prompt)
    cached = SamplingParams(max_tokens=3, **GREEDY)
    wants = SamplingParams(max_tokens=3, prompt_logprobs=3, **GREEDY)
    llm.generate({"prompt_token_ids": prompt}, cached)  # the prompt is now in the cache
    hits = llm.stats()["prefix_cache_hits"]
    out = llm.generate({"prompt_token_ids": prompt}, wants)[0]
    check_prompt_logprobs(out.prompt_logprobs, prompt, ref, 3, llm.tokenizer.decode)
    assert llm.stats()["prefix_cache_hits"] == hits  # it computed the whole prompt
    llm.generate({"prompt_token_ids": prompt}, cached)
    assert llm.stats()["prefix_cache_hits"] >= hits + (len(prompt) - 1) // B * B  # still there
    # arriving together with requests that share it (they wait for its blocks, it does not)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, [cached, wants, cached])
    check_prompt_logprobs(outs[1].prompt_logprobs, prompt, ref, 3, llm.tokenizer.decode)
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None


def test_n_continuations_share_one_prompt_logprobs(
        checkpoints: dict[str, pathlib.Path], engines: list[LLM]) -> None:
    path = checkpoints["gemma3_text"]
    llm = make_llm(path)
    engines.append(llm)
    prompt = random_tokens(2 * W + 1, seed=6)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=3, max_tokens=4, seed=1, prompt_logprobs=2))[0]
    assert len(out.outputs) == 3
    check_prompt_logprobs(out.prompt_logprobs, prompt, hf_logprobs(hf_reference(path), prompt),
                          2, llm.tokenizer.decode)


# -- the server, through the official client ----------------------------------------------

SERVER_FLAGS = ("--dtype", "float32", "--block-size", "4", "--kv-cache-memory", "4MiB",
                "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "8",
                "--debug-kv")


@pytest.fixture(scope="module")
def server(checkpoints: dict[str, pathlib.Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(checkpoints["gemma3_text"], *SERVER_FLAGS, "--served-model-name", "tiny",
                    log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s
    stats = s.stats() if s.process.poll() is None else None
    assert stats is None or stats["kv_read_misses_total"] == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(checkpoints: dict[str, pathlib.Path]) -> Any:
    return AutoTokenizer.from_pretrained(checkpoints["gemma3_text"])


@pytest.fixture(scope="module")
def ref(checkpoints: dict[str, pathlib.Path]) -> Any:
    return hf_reference(checkpoints["gemma3_text"])


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return list(out[0, len(ids):].tolist())


class Entry:
    """A prompt_logprobs entry of a response body, read like the engine's `Logprob`."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.logprob, self.rank = body["logprob"], body["rank"]
        self.decoded_token = body["decoded_token"]


def from_body(body: list[dict[str, Any] | None]) -> list[dict[int, Entry] | None]:
    return [None if e is None else {int(t): Entry(v) for t, v in e.items()} for e in body]


def expected_echo_logprobs(tok: Any, ids: list[int], num_prompt: int, logp: torch.Tensor,
                           k: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs over prompt + output, as vLLM fills them under echo: the
    prompt's top_logprobs hold the token itself besides the k likeliest, the output's the k
    likeliest."""
    tokens = [tok.decode([t]) for t in ids]
    top: list[dict[str, float] | None] = [None]
    for i in range(1, len(ids)):
        row = logp[i - 1]
        best = row.topk(k).indices.tolist()
        keys = [ids[i], *best] if i < num_prompt else best
        top.append({tok.decode([t]): float(row[t]) for t in keys})
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens,
            "token_logprobs": [None] + [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))],
            "top_logprobs": top, "text_offset": offsets}


def check_echo_logprobs(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=TOL)
    for g, w in zip(got["top_logprobs"][1:], want["top_logprobs"][1:], strict=True):
        assert g.keys() == w.keys() and list(g.values()) == pytest.approx(list(w.values()),
                                                                           abs=TOL)


PROMPT = "The ring buffer overwrites the oldest token in the window. Once upon"


def test_echo_with_logprobs_covers_prompt_and_output(client: openai.OpenAI, tok: Any,
                                                     ref: Any) -> None:
    ids = tok.encode(PROMPT)
    assert len(ids) > 2 * W  # several chunks of 8, past the window
    r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=2,
                                  max_tokens=3, temperature=0)
    out = hf_greedy(ref, ids, 3)
    choice = r.choices[0]
    assert choice.text == PROMPT + tok.decode(out)
    assert choice.logprobs is not None
    check_echo_logprobs(choice.logprobs.model_dump(), expected_echo_logprobs(
        tok, ids + out, len(ids), hf_logprobs(ref, ids + out), 2))
    assert choice.model_extra is None or choice.model_extra.get("prompt_logprobs") is None


def test_streamed_echo_with_logprobs_adds_up_to_the_same(client: openai.OpenAI, tok: Any,
                                                         ref: Any) -> None:
    prompts = [PROMPT, "Café, naïve, résumé"]
    chunks = list(client.completions.create(model="tiny", prompt=prompts, echo=True,
                                            logprobs=1, max_tokens=4, temperature=0,
                                            stream=True))
    got: dict[int, dict[str, list[Any]]] = {}
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.logprobs is not None:
                acc = got.setdefault(ch.index, {"tokens": [], "token_logprobs": [],
                                                "top_logprobs": [], "text_offset": []})
                for key in acc:
                    acc[key] += getattr(ch.logprobs, key)
    for index, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        out = hf_greedy(ref, ids, 4)
        assert texts[index] == prompt + tok.decode(out)
        check_echo_logprobs(got[index], expected_echo_logprobs(
            tok, ids + out, len(ids), hf_logprobs(ref, ids + out), 1))


def test_completions_prompt_logprobs_on_each_choice(client: openai.OpenAI, tok: Any,
                                                    ref: Any) -> None:
    ids = tok.encode(PROMPT)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                  n=2, extra_body={"prompt_logprobs": 1})
    logp = hf_logprobs(ref, ids)
    for choice in r.choices:
        assert choice.model_extra is not None
        check_prompt_logprobs(from_body(choice.model_extra["prompt_logprobs"]), ids, logp, 1,
                              tok.decode)


def test_chat_prompt_logprobs_at_the_top_level(client: openai.OpenAI, tok: Any,
                                               ref: Any) -> None:
    messages = [{"role": "user", "content": "Once upon a time, there was a little girl"}]
    r = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                       max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(rendered, add_special_tokens=False)
    assert r.model_extra is not None
    check_prompt_logprobs(from_body(r.model_extra["prompt_logprobs"]), ids,
                          hf_logprobs(ref, ids), 2, tok.decode)


def test_prompt_logprobs_with_stream_is_refused_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="Once", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert "prompt_logprobs" in str(err.value)


def test_bad_words_reach_the_engine(client: openai.OpenAI, tok: Any, ref: Any) -> None:
    ids = tok.encode(PROMPT)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                      temperature=0)
    word, banned = single_token_word(tok, hf_greedy(ref, ids, 8))
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"bad_words": [word]})
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8,
                           do_sample=False, bad_words_ids=banned)
    assert r.choices[0].text == tok.decode(out[0, len(ids):].tolist())
    assert r.choices[0].text != plain.choices[0].text
