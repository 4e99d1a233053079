"""Tool calls in chat: what the prompt shows of the tools, how ``tool_choice`` constrains the
output, and how calls are read back out of the text (batch and streaming).

- ``none``: the tools stay out of the prompt and nothing is parsed.
- ``auto``: the model writes calls in its own format, read by the server's tool-call parser
  (``--tool-call-parser``; ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``). A chat template that knows tools renders them itself; for one that does
  not (gemma-3's), the tools, the calls and the tool results are written into the messages
  in the hermes format, so any model can take part.
- ``required`` and a named function: the output is generated under a JSON schema built from
  the tools' parameters (as vLLM does), so it always parses: an array of
  ``{"name", "parameters"}`` for ``required``, the arguments object for a named function.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringserve.engine import StructuredOutputsParams
from ringserve.server.errors import APIError
from ringserve.server.json_values import json_value_problem
from ringserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    Tool,
)

TOOL_CALL_PARSERS = ("hermes", "openai")  # openai: server/harmony.py
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or call_id()

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


# -- tool_choice -----------------------------------------------------------------------


def tool_choice(req: ChatCompletionRequest, parser: str | None) -> str | NamedToolChoice:
    """The effective choice (OpenAI: ``auto`` when tools are given, else ``none``), checked.

    Raises:
        APIError: 400 naming ``tool_choice``.
    """
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not "
                           f"one of the tools ({', '.join(names)})", param="tool_choice")
    if choice == "auto" and parser is None:
        raise APIError(400, 'tool_choice "auto" needs a tool-call parser; start the server '
                       "with --tool-call-parser hermes, or use \"required\" or a named "
                       "function", param="tool_choice")
    constrained = req.structured_outputs is not None or (
        req.response_format is not None and req.response_format.type != "text")
    if constrained and (choice == "required" or isinstance(choice, NamedToolChoice)):
        raise APIError(400, "a required or named tool_choice constrains the output itself; "
                       "it cannot be combined with response_format or structured_outputs",
                       param="tool_choice")
    return choice


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_constraint(req: ChatCompletionRequest,
                    choice: str | NamedToolChoice) -> StructuredOutputsParams | None:
    """The JSON schema a required or named choice generates under (None otherwise)."""
    tools = req.tools or []
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=_parameters(tool))
    if choice != "required":
        return None
    one_call = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [t.function.name]},
                       "parameters": _parameters(t)},
        "required": ["name", "parameters"]} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def constrained_calls(text: str, choice: str | NamedToolChoice) -> list[ParsedCall]:
    """The calls in the output of a required or named choice (which the grammar made
    valid JSON, unless the length limit cut it)."""
    if isinstance(choice, NamedToolChoice):
        return [ParsedCall(choice.function.name, text)]
    return [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in _whole_items(text) if isinstance(c, dict) and "name" in c]


def _whole_items(text: str) -> list[Any]:
    """The items of a JSON array that are whole, even if the array was cut off."""
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    items: list[Any] = []
    if pos == 0:
        return items
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items
        items.append(item)


# -- the prompt ------------------------------------------------------------------------


def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def render_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None,
                    native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages (and tools) for ``apply_chat_template``.

    With a template that knows tools (``native``) the history keeps its ``tool_calls``
    (arguments as objects, which templates print with ``tojson``) and ``tool`` messages,
    and the tools are passed as they are. Otherwise the tools go into the system message,
    calls into the assistant's text and results into user turns, all in the hermes format.
    """
    if native:
        out = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _as_object(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.reasoning_content:  # gpt-oss's template reads an assistant's "thinking"
                d["thinking"] = m.reasoning_content
            out.append(d)
        return out, [t.model_dump(exclude_none=True) for t in tools] if tools else None
    out = []
    for m in messages:
        text = m.text()
        if m.role == "tool":
            wrapped = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + wrapped  # results of parallel calls: one turn
                continue
            out.append({"role": "user", "content": wrapped, "_tool": True})
            continue
        if m.tool_calls:
            calls = "\n".join(
                f'{OPEN}\n{json.dumps({"name": c.function.name, "arguments": _as_object(c.function.arguments)}, ensure_ascii=False)}\n{CLOSE}'  # noqa: E501
                for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        out.append({"role": m.role, "content": text})
    for d in out:
        d.pop("_tool", None)
    if tools:
        preamble = hermes_system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, None


def hermes_system_prompt(tools: Sequence[Tool]) -> str:
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False)
                       for t in tools)
    return ("You may call one or more functions to help with the user's request. The "
            f"functions you can call:\n<tools>\n{listed}\n</tools>\nTo call a function, "
            "answer with a JSON object of its name and arguments inside tags, one per "
            f'call:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}'
            f"\n{CLOSE}")


def _as_object(arguments: str) -> Any:
    """The arguments as an object for the template, or their text as it came when it is
    not JSON the server can pass on (a lone surrogate escape, NaN, a number past int64,
    nesting past the parser's or the template's limits)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):  # ValueError: also an int of too many digits
        return arguments
    return arguments if json_value_problem(value) is not None else value


# -- the hermes parser -----------------------------------------------------------------

_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def _call(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedCall(obj["name"], args if isinstance(args, str)
                      else json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole output. A block whose JSON does not parse stays in the
    content; an unclosed last block (the model stopped before ``</tool_call>``) counts when
    its JSON is whole."""
    calls: list[ParsedCall] = []
    content: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        content.append(text[pos : m.start()])
        calls.append(call)
        pos = m.end()
    rest = text[pos:]
    at = rest.find(OPEN)
    if at != -1 and (call := _call(rest[at + len(OPEN):])) is not None:
        calls.append(call)
        rest = rest[:at]
    content.append(rest)
    joined = "".join(content)
    if calls:
        joined = joined.strip()
    return (joined or None) if calls else joined, calls


class HermesStream:
    """Feeds streamed text; returns the content safe to show and the calls completed.

    Text that might begin ``<tool_call>`` is held back until it cannot; a block is held
    until ``</tool_call>`` closes it (or the stream ends).
    """

    def __init__(self) -> None:
        self.buffer = ""
        self.pending = ""  # whitespace not yet shown: around calls it is not content
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            at = self.buffer.find(OPEN)
            if at == -1:
                keep = _partial_tag(self.buffer)
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            content.append(self.buffer[:at])
            end = self.buffer.find(CLOSE, at)
            if end == -1:
                self.buffer = self.buffer[at:]
                break
            block = self.buffer[at : end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE):]
            call = _call(block[len(OPEN): -len(CLOSE)])
            if call is None:
                content.append(block)
            else:
                calls.append(call)
        self.calls += len(calls)
        return self._content("".join(content)), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What is left once the output ended: an unclosed call whose JSON is whole, or
        content."""
        rest, self.buffer = self.buffer, ""
        if rest.startswith(OPEN) and (call := _call(rest[len(OPEN):])) is not None:
            self.calls += 1
            return "", [call]
        text = self._content(rest)
        if not text and not self.calls:
            text, self.pending = self.pending, ""
        return text, []

    def _content(self, text: str) -> str:
        text = self.pending + text
        if not text.strip():
            self.pending = text
            return ""
        self.pending = ""
        return text


def _partial_tag(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


# -- one choice's calls ------------------------------------------------------------------


class ChoiceCalls:
    """Reads one choice's tool calls out of its text, whole or as it streams.

    Args:
        choice: ``auto`` (the text is parsed by ``parser``), ``required`` or a named
            function (the text is the constrained JSON).
    """

    def __init__(self, choice: str | NamedToolChoice) -> None:
        self.choice = choice
        self.hermes = HermesStream() if choice == "auto" else None
        self.text = ""
        self.sent = 0  # calls streamed so far
        self.named_id = call_id()

    def whole(self, text: str, finish_reason: str | None
              ) -> tuple[str | None, list[ParsedCall], str | None]:
        """(content, calls, finish_reason) of a finished choice."""
        if self.choice == "auto":
            content, calls = parse_hermes(text)
        else:
            content, calls = None, constrained_calls(text, self.choice)
            if isinstance(self.choice, NamedToolChoice):
                calls[0].id = self.named_id
        return content, calls, _finish(finish_reason, calls)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool_calls deltas) for streamed ``text``."""
        if self.hermes is not None:
            content, calls = self.hermes.feed(text)
            if finished:
                more, last = self.hermes.finish()
                content, calls = content + more, calls + last
            return content, self._numbered(calls)
        if isinstance(self.choice, NamedToolChoice):
            deltas: list[dict[str, Any]] = []
            if not self.sent:
                self.sent = 1
                deltas.append(ParsedCall(self.choice.function.name, "", self.named_id).body(0))
            if text:
                deltas.append({"index": 0, "function": {"arguments": text}})
            return "", deltas
        self.text += text  # required: a JSON array, read once it is whole
        return "", self._numbered(constrained_calls(self.text, self.choice)) if finished else []

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.sent else reason

    def _numbered(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        out = [c.body(self.sent + i) for i, c in enumerate(calls)]
        self.sent += len(calls)
        return out


def _finish(reason: str | None, calls: list[ParsedCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason
