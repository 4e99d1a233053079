"""Bad input gets OpenAI's error body with the right status and `param`, and loses nothing."""

from __future__ import annotations

import json
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ringserve.server.app import create_app
from ringserve.server.state import ServeArgs
from tests.server_utils import Server, run_server
from tests.tiny_models import make_checkpoint

FLAGS = ("--block-size", "4", "--kv-cache-memory", "4MiB", "--max-model-len", "128",
         "--debug-kv")
MSG = [{"role": "user", "content": "hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"

BAD: list[tuple[str, str, Any, int, str | None]] = [
    ("unknown field", C, {"prompt": "x", "foo": 1}, 400, "foo"),
    ("temperature too high", C, {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("temperature wrong type", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("max_tokens zero", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens fractional", C, {"prompt": "x", "max_tokens": 3.5}, 400, "max_tokens"),
    ("max_tokens past max_model_len", C, {"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ("empty prompt", C, {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", C, {"prompt": []}, 400, "prompt"),
    ("missing prompt", C, {}, 400, "prompt"),
    ("prompt too long", C, {"prompt": [5] * 200}, 400, "prompt"),
    ("token out of vocab", C, {"prompt": [1, 99999]}, 400, "prompt"),
    ("n zero", C, {"prompt": "x", "n": 0}, 400, "n"),
    ("top_p zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("logprobs too many", C, {"prompt": "x", "logprobs": 9}, 400, "logprobs"),
    ("seed not an int", C, {"prompt": "x", "seed": "abc"}, 400, "seed"),
    ("five stop strings", C, {"prompt": "x", "stop": list("abcde")}, 400, "stop"),
    ("frequency_penalty past 2", C, {"prompt": "x", "frequency_penalty": 2.5}, 400,
     "frequency_penalty"),
    ("presence_penalty past -2", CHAT, {"messages": MSG, "presence_penalty": -3}, 400,
     "presence_penalty"),
    ("logit_bias key not a token id", C, {"prompt": "x", "logit_bias": {"a": 10}}, 400,
     "logit_bias"),
    ("logit_bias past 100", C, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias out of vocab", C, {"prompt": "x", "logit_bias": {"99999": 1}}, 400,
     "logit_bias"),
    ("repetition_penalty zero", C, {"prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("min_p past 1", C, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("min_tokens past max_tokens", C, {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400,
     "min_tokens"),
    ("suffix", C, {"prompt": "x", "suffix": "end"}, 400, "suffix"),
    ("unknown model", C, {"prompt": "x", "model": "nope"}, 404, "model"),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    ("tool message without its call id", CHAT, {"messages": [{"role": "tool",
                                                               "content": "x"}]}, 400,
     "messages.0"),
    ("unknown role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("tool without a function", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400,
     "tools.0.function"),
    ("json_schema without a schema", C, {"prompt": "x", "response_format": {
        "type": "json_schema"}}, 400, "response_format"),
    ("regex that does not compile", C, {"prompt": "x", "structured_outputs": {
        "regex": "a{2,1}"}}, 400, "structured_outputs.regex"),
    ("top_logprobs alone", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat unknown model", CHAT, {"messages": MSG, "model": "nope"}, 404, "model"),
    ("tokenize nothing", "/tokenize", {}, 400, "prompt"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("mistral", tmp_path_factory.mktemp("ckpt"), chat_template=False)


@pytest.fixture(scope="module")
def server(ckpt: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(ckpt, *FLAGS, log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s


def check_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["message"]
    return dict(body["error"])


@pytest.mark.parametrize(("path", "body", "status", "param"),
                         [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request(server: Server, path: str, body: Any, status: int,
                     param: str | None) -> None:
    check_error(httpx.post(server.url + path, json=body, timeout=30), status, param)


def test_bad_requests_leave_the_server_clean(server: Server) -> None:
    check_error(httpx.post(server.url + C, content=b"{not json",
                           headers={"content-type": "application/json"}), 400, None)
    r = httpx.post(server.url + C, json={"prompt": "still serving", "max_tokens": 5},
                   timeout=30)
    assert r.status_code == 200
    stats = server.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0
    assert stats["http_requests_rejected_total"] >= len(BAD)
    assert stats["requests_rejected_total"] >= 4  # the engine's own refusals among them
    assert stats["kv_read_misses_total"] == 0


def test_chat_without_a_template_is_a_400(server: Server) -> None:
    err = check_error(httpx.post(server.url + CHAT, json={"messages": MSG}), 400, "messages")
    assert "chat template" in err["message"]


def test_oversized_body_is_413(server: Server) -> None:
    big = json.dumps({"prompt": "x" * (5 * 2**20)})
    r = httpx.post(server.url + C, content=big, headers={"content-type": "application/json"},
                   timeout=60)
    check_error(r, 413, None)


def test_api_key_401_and_queue_full_429(ckpt: pathlib.Path, tmp_path: pathlib.Path) -> None:
    flags = (*FLAGS, "--api-key", "s3cret", "--max-num-seqs", "1", "--max-waiting", "1",
             "--max-num-batched-tokens", "8")
    with run_server(ckpt, *flags, log_dir=tmp_path) as s:
        check_error(httpx.post(s.url + C, json={"prompt": "x"}), 401, None)
        check_error(httpx.post(s.url + C, json={"prompt": "x"},
                               headers={"Authorization": "Bearer wrong"}), 401, None)
        assert httpx.get(s.url + "/health").status_code == 200  # probes need no key
        auth = {"Authorization": "Bearer s3cret"}
        long = {"prompt": "x", "max_tokens": 120, "ignore_eos": True}
        # NOTE: six requests at once against one running and one waiting slot: whatever
        # the timing, the first is taken and the queue fills before the last arrive (a
        # poll for the transient "one running, one waiting" state missed it on fast runs).
        results: list[httpx.Response] = []
        barrier = threading.Barrier(6)

        def send() -> None:
            barrier.wait()
            results.append(httpx.post(s.url + C, json=long, headers=auth, timeout=120))

        threads = [threading.Thread(target=send) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = sorted(r.status_code for r in results)
        assert set(statuses) == {200, 429}, statuses
        for r in results:
            if r.status_code == 429:
                check_error(r, 429, None)
                assert r.json()["error"]["code"] == "queue_full"
            else:  # the ones taken ran to the end
                assert r.json()["usage"]["completion_tokens"] == 120


def test_503_while_the_engine_is_not_ready() -> None:
    app = create_app(ServeArgs(model="unused"))
    client = TestClient(app)  # no `with`: the lifespan (engine start) never runs
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "starting"
    check_error(client.post(C, json={"prompt": "x"}), 503, None)
    check_error(client.get("/v1/models"), 503, None)
