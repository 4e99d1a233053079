"""gpt-oss's harmony output read into OpenAI chat messages (`server.harmony`), whole and
streamed, and the chat route's answers for it checked with the official ``openai`` types.

The outputs are written as OpenAI's harmony format documents them (the generation prompt
ends with ``<|start|>assistant``, so an output begins inside its first header).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ringserve.server.harmony import HarmonyStream, is_harmony, parse_harmony

REASON_THEN_CALL = (
    "<|channel|>analysis<|message|>Need the weather; call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location": "Tokyo", "unit": "c"}<|call|>')
REASON_THEN_ANSWER = (
    "<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
# the recipient in the role part, a preamble to the user first, two calls in a row
PREAMBLE_TWO_CALLS = (
    "<|channel|>commentary<|message|>Checking both cities.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"location": "Paris"}<|call|>'
    "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
    '{"zone": "CET"}<|call|>')


def test_reasoning_and_a_call() -> None:
    out = parse_harmony(REASON_THEN_CALL)
    assert out.reasoning == "Need the weather; call the tool."
    assert out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"location": "Tokyo", "unit": "c"})]


def test_reasoning_and_an_answer() -> None:
    out = parse_harmony(REASON_THEN_ANSWER)
    assert (out.reasoning, out.content, out.calls) == ("User asks 2+2. Simple.", "2 + 2 = 4.", [])


def test_a_preamble_and_two_calls() -> None:
    out = parse_harmony(PREAMBLE_TWO_CALLS)
    assert out.content == "Checking both cities." and out.reasoning == ""
    assert [c.name for c in out.calls] == ["get_weather", "get_time"]
    assert json.loads(out.calls[1].arguments) == {"zone": "CET"}


def test_without_tools_a_call_is_not_read_and_the_stop_token_may_be_absent() -> None:
    assert parse_harmony(REASON_THEN_CALL, tools=False).calls == []
    # the engine ends at <|return|> / <|call|> (gpt-oss's end tokens) and may drop them
    cut = REASON_THEN_ANSWER.removesuffix("<|return|>")
    assert parse_harmony(cut).content == "2 + 2 = 4."


@pytest.mark.parametrize("text", [REASON_THEN_CALL, REASON_THEN_ANSWER, PREAMBLE_TWO_CALLS])
@pytest.mark.parametrize("step", [1, 3, 17])
def test_streaming_gives_what_the_whole_text_gives(text: str, step: int) -> None:
    stream = HarmonyStream()
    content = reasoning = ""
    calls = []
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        out = stream.feed(piece, i == len(pieces) - 1)
        content, reasoning = content + out.content, reasoning + out.reasoning
        calls += out.calls
        # nothing special ever leaks into what is shown
        assert "<|" not in out.content and "<|" not in out.reasoning
    whole = parse_harmony(text)
    assert (content, reasoning) == (whole.content, whole.reasoning)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments)
                                                       for c in whole.calls]


def test_a_call_streams_once_its_body_has_ended() -> None:
    stream = HarmonyStream()
    head, _, tail = REASON_THEN_CALL.partition('"unit"')
    assert stream.feed(head, False).calls == []
    assert [c.name for c in stream.feed('"unit"' + tail, False).calls] == ["get_weather"]


def test_an_output_that_ignores_the_format_is_content() -> None:
    assert parse_harmony("just words").content == "just words"
    stream = HarmonyStream()
    assert stream.feed("just ", False).content == ""  # it might be a header
    assert stream.feed("words", True).content == "just words"


def test_a_harmony_template_is_recognised() -> None:
    class Tok:
        chat_template = "{{ '<|start|>' + m.role + '<|channel|>final<|message|>' }}"

    class Plain:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    assert is_harmony(Tok()) and not is_harmony(Plain())


# -- the chat route on harmony outputs --------------------------------------------------


class _Seq:
    def __init__(self, text: str, finish: str | None) -> None:
        self.index, self.text, self.finish_reason, self.logprobs = 0, text, finish, []


class _Delta:
    def __init__(self, text: str, finish: str | None) -> None:
        self.seqs = [_Seq(text, finish)]
        self.prompt_tokens, self.completion_tokens, self.prompt_logprobs = 5, 7, None


def _fake_merged(text: str, step: int) -> Any:
    async def merged(_llm: Any, _requests: Any) -> Any:
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            yield None, _Delta(piece, "stop" if i == len(pieces) - 1 else None)
    return merged


class _Params:
    logprobs = None
    prompt_logprobs = None


class _Request:
    params = _Params()


class _LLM:
    tokenizer = None  # the attribute the route reads


@pytest.mark.parametrize(("text", "tools"), [(REASON_THEN_CALL, "auto"),
                                             (REASON_THEN_ANSWER, None),
                                             (PREAMBLE_TWO_CALLS, "auto")])
def test_the_route_answers_as_openai_reads_it(monkeypatch: pytest.MonkeyPatch, text: str,
                                              tools: str | None) -> None:
    from ringserve.server.routes import chat

    monkeypatch.setattr(chat, "merged", _fake_merged(text, 1000))
    body = asyncio.run(chat._complete(_LLM(), [_Request()], "chatcmpl-1", "m", tools,
                                      harmony=True))
    reply = ChatCompletion.model_validate(body.model_dump(exclude_none=True))
    whole = parse_harmony(text, tools=tools is not None)
    message = reply.choices[0].message
    assert (message.content or "") == whole.content
    assert getattr(message, "reasoning_content", None) == (whole.reasoning or None)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        (c.name, c.arguments) for c in whole.calls]
    assert reply.choices[0].finish_reason == ("tool_calls" if whole.calls else "stop")

    monkeypatch.setattr(chat, "merged", _fake_merged(text, 5))

    async def stream() -> list[str]:
        return [c async for c in chat._stream(_LLM(), [_Request()], "chatcmpl-1", "m",
                                              False, tools, harmony=True)]
    chunks = [ChatCompletionChunk.model_validate(json.loads(line[len("data: "):]))
              for line in asyncio.run(stream()) if line != "data: [DONE]\n\n"]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks)
    names = [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert (content, reasoning) == (whole.content, whole.reasoning)
    assert names == [c.name for c in whole.calls]
    assert chunks[-1].choices[0].finish_reason == ("tool_calls" if whole.calls else "stop")
