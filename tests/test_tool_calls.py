"""The hermes tool-call parser, whole and streamed, and how tools reach the chat template.

Streaming must agree with parsing the whole text, however the text is cut into deltas
(hypothesis draws the cuts); the template tests render through transformers'
`apply_chat_template`, the function every HF model's chat format goes through.
"""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.server.protocol import ChatMessage, Tool
from ringserve.server.tools import (
    ChoiceCalls,
    HermesStream,
    constrained_calls,
    parse_hermes,
    render_messages,
)
from tests.tiny_models import byte_bpe_tokenizer

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'

TEXTS = [
    "no calls here, only <tool text that looks like a tag",
    CALL_A,
    f"Let me look. {CALL_A}",
    f"{CALL_A}\n{CALL_B}\n",
    f"before {CALL_A} between {CALL_B} after",
    "broken <tool_call>{not json}</tool_call> stays content",
    f'{CALL_A}\n<tool_call>{{"name": "get_time", "arguments": {{"zone": "CET"}}}}',
    "half a tag at the end <tool_ca",
]


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_parse_whole_outputs() -> None:
    assert parse_hermes(TEXTS[0]) == (TEXTS[0], [])
    content, calls = parse_hermes(f"Let me look. {CALL_A}")
    assert content == "Let me look."
    assert _calls(calls) == [("get_weather", {"city": "Paris"})]
    content, calls = parse_hermes(f"{CALL_A}\n{CALL_B}\n")
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    content, calls = parse_hermes(TEXTS[5])
    assert content == TEXTS[5] and calls == []
    content, calls = parse_hermes(TEXTS[6])  # an unclosed last call whose JSON is whole
    assert content is None
    assert _calls(calls)[1] == ("get_time", {"zone": "CET"})


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=12))
def test_streaming_agrees_with_the_whole_text(text: str, cuts: list[int]) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream = HermesStream()
    content, calls = "", []
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    for piece in pieces:
        more, new = stream.feed(piece)
        content += more
        calls += new
    more, new = stream.finish()
    content += more
    calls += new
    whole_content, whole_calls = parse_hermes(text)
    assert _calls(calls) == _calls(whole_calls)
    assert content.strip() == (whole_content or "").strip()
    # nothing that could start a tag is shown before it is known not to be one
    assert "<tool_call>" not in content or "broken" in text


WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}})
HISTORY = [
    ChatMessage(role="user", content="Weather in Paris and Rome?"),
    ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}),
    ChatMessage(role="tool", tool_call_id="call_1", content="21C"),
    ChatMessage(role="tool", tool_call_id="call_2", content="25C"),
]


def test_a_template_without_tools_gets_them_in_the_hermes_format() -> None:
    tok = byte_bpe_tokenizer()  # its template knows only role and content
    messages, tools = render_messages(HISTORY, [WEATHER], native=False)
    assert tools is None
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|system|>") and '"name": "get_weather"' in text
    assert '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' \
        in text
    # the results of the two parallel calls come back as one user turn
    assert text.count("<|user|>") == 2
    assert "<tool_response>\n21C\n</tool_response>\n<tool_response>\n25C" in text
    assert text.endswith("<|assistant|>")


def test_a_template_that_knows_tools_gets_them_as_objects() -> None:
    tok = byte_bpe_tokenizer()
    tok.chat_template = (
        "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}:"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "CALL {{ c.function.name }} {{ c.function.arguments | tojson }};{% endfor %}"
        "{% else %}{{ m['content'] }}{% endif %}"
        "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}")
    messages, tools = render_messages(HISTORY, [WEATHER], native=True)
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert 'TOOLS=[{"type": "function", "function": {"name": "get_weather"' in text
    assert 'CALL get_weather {"city": "Paris"};CALL get_weather {"city": "Rome"};' in text
    assert "tool:21C (call_1)" in text


def test_required_calls_cut_by_the_length_limit_keep_the_whole_ones() -> None:
    text = ('[\n{"name": "get_weather", "parameters": {"city": "Paris"}},\n'
            '{"name": "get_time", "parameters": {"zo')
    calls = constrained_calls(text, "required")
    assert _calls(calls) == [("get_weather", {"city": "Paris"})]
    content, calls, reason = ChoiceCalls("required").whole(text, "length")
    assert content is None and len(calls) == 1 and reason == "length"
    _, calls, reason = ChoiceCalls("required").whole(text[:60] + "}]", "stop")
    assert reason == "tool_calls" and _calls(calls) == [("get_weather", {"city": "Paris"})]
