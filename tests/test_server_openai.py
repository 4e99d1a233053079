"""A real uvicorn server on 127.0.0.1, driven by the official `openai` client.

The checkpoint is a tiny random gemma3 (sliding and full layers) with a chat template and an
end-of-sequence id; greedy results are compared with transformers on the same folder.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import openai
import pytest
import torch

from tests.server_utils import Server, run_server
from tests.tiny_models import hf_reference, make_checkpoint

SERVER_FLAGS = ("--dtype", "float32", "--block-size", "4", "--kv-cache-memory", "4MiB",
                "--max-model-len", "256",
                "--max-num-batched-tokens", "64", "--debug-kv")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"), eos=True)


@pytest.fixture(scope="module")
def server(ckpt: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(ckpt, *SERVER_FLAGS, "--served-model-name", "tiny",
                    log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s
    stats = s.stats() if s.process.poll() is None else None
    assert stats is None or stats["kv_read_misses_total"] == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def hf_greedy_text(ckpt: pathlib.Path, prompt_ids: list[int], n: int) -> list[int]:
    model = hf_reference(ckpt)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return list(out[0, len(prompt_ids):].tolist())


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_matches_transformers_and_counts_usage(
        client: openai.OpenAI, ckpt: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    prompt = "The ring buffer overwrites"
    ids = tok.encode(prompt)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    expected = hf_greedy_text(ckpt, ids, 20)
    eos = tok.eos_token_id
    body = expected[: expected.index(eos)] if eos in expected else expected
    assert r.choices[0].text == tok.decode(body, skip_special_tokens=True)
    assert r.choices[0].finish_reason == ("stop" if eos in expected else "length")
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(expected[: len(body) + (eos in expected)])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_completion_adds_up_and_ends_with_usage(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="tiny", prompt=["Café", "漢字"], n=2,
                                      max_tokens=16, temperature=0)
    chunks = list(client.completions.create(
        model="tiny", prompt=["Café", "漢字"], n=2, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in plain.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    finals = [ch for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(ch.index for ch in finals) == [0, 1, 2, 3]


def test_chat_and_streaming_chat(client: openai.OpenAI, ckpt: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about the ring."}]
    r = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                       max_completion_tokens=12, temperature=0)
    tok = AutoTokenizer.from_pretrained(ckpt)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(rendered, add_special_tokens=False)
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    expected = hf_greedy_text(ckpt, ids, 12)
    eos = tok.eos_token_id
    body = expected[: expected.index(eos)] if eos in expected else expected
    assert r.choices[0].message.content == tok.decode(body, skip_special_tokens=True)
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=12,  # type: ignore[arg-type]
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage == r.usage


def test_stop_n_and_seed(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt="Once upon", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip())
    cut = client.completions.create(model="tiny", prompt="Once upon", max_tokens=24,
                                    temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kw = dict(model="tiny", prompt="Once upon", max_tokens=16, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(n=3, seed=1234, **kw)  # type: ignore[call-overload]
    b = client.completions.create(n=3, seed=1234, **kw)  # type: ignore[call-overload]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len(a.choices) == 3 and len({c.text for c in a.choices}) > 1


def test_logprobs_in_both_shapes(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 4 and len(lp.top_logprobs or []) == 4
    assert all(v <= 0 for v in lp.token_logprobs or [])
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6
               for t in content)


def test_tokenize_detokenize_version_health(server: Server) -> None:
    import httpx

    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Café 🚀"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert "Café 🚀" in back["prompt"]
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ready"}


def test_penalties_and_biases_match_transformers_generate(
        client: openai.OpenAI, ckpt: pathlib.Path) -> None:
    """repetition_penalty, min_tokens (vLLM's extras) and presence/frequency penalties and
    logit_bias (OpenAI's) through the official client; greedy, against transformers'
    `generate` with the same processors where it has them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    prompt = "The ring buffer overwrites the oldest"
    ids = tok.encode(prompt)
    model = hf_reference(ckpt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                             do_sample=False, repetition_penalty=1.8)
    expected = tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body={"repetition_penalty": 1.8, "min_tokens": 16})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    forced = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                       temperature=0, logit_bias={"60": 100})
    assert forced.choices[0].text == tok.decode([60] * 6, skip_special_tokens=True)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        temperature=0.8, seed=5, presence_penalty=1.5, frequency_penalty=-0.5,
        extra_body={"min_p": 0.1})
    assert chat.choices[0].message.content is not None
