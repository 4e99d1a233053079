"""gpt-oss's output format (OpenAI's "harmony"), read into an OpenAI chat message.

A harmony model answers in messages, each ``<|start|>{header}<|message|>{body}`` ended by
``<|end|>``, ``<|call|>`` (a tool call: the model waits for its result) or ``<|return|>``
(the answer is done). The header names the role, a channel (``<|channel|>analysis``,
``commentary`` or ``final``), and, for a tool call, the recipient (``to=functions.NAME``,
before or after the channel) and the arguments' format (``<|constrain|>json``). The
generation prompt ends with ``<|start|>assistant``, so the output starts inside the first
header. Read into the chat API (as vLLM's ``openai`` tool-call parser does):

- ``analysis`` bodies: the reasoning (``reasoning_content``);
- a body to ``functions.NAME``: a tool call, its body the arguments (JSON text);
- ``final`` bodies and ``commentary`` ones to nobody (the preambles a model writes before
  a call): the content.

The text must keep the special tokens (the server decodes harmony outputs with
``skip_special_tokens=False``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ringserve.server.tools import ParsedCall

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def is_harmony(tokenizer: object) -> bool:
    """Whether a tokenizer's chat template writes harmony messages (gpt-oss)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and CHANNEL in template and "<|message|>" in template


@dataclass
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    body: str
    ended: bool  # its end token has been seen (else the output stopped, or is streaming)


def messages(text: str) -> list[HarmonyMessage]:
    """The messages of an output, the last one possibly unfinished; a header without its
    ``<|message|>`` yet is left out."""
    out = []
    for segment in text.split(START):
        header, sep, rest = segment.partition(MESSAGE)
        if not sep:
            continue
        ends = [i for i in (rest.find(e) for e in ENDS) if i != -1]
        cut = min(ends) if ends else len(rest)
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        out.append(HarmonyMessage(channel.group(1) if channel else None,
                                  recipient.group(1) if recipient else None,
                                  rest[:cut], bool(ends)))
    return out


def _call(message: HarmonyMessage) -> ParsedCall:
    name = message.recipient or ""
    return ParsedCall(name.removeprefix("functions."), message.body.strip())


@dataclass
class HarmonyOutput:
    content: str = ""
    reasoning: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def parse_harmony(text: str, *, tools: bool = True) -> HarmonyOutput:
    """The content, reasoning and (with ``tools``) calls of a whole output; an output
    with no message at all (a model that ignored the format) is all content."""
    out = HarmonyOutput()
    found = messages(text)
    if not found:
        out.content = text
    for m in found:
        if m.recipient is not None:
            if tools:
                out.calls.append(_call(m))
        elif m.channel == "analysis":
            out.reasoning += m.body
        else:
            out.content += m.body
    return out


class HarmonyStream:
    """Reads a harmony output as it streams: the content and reasoning not shown yet, and
    each call once its body has ended (``<|call|>``, or the end of the output)."""

    def __init__(self, *, tools: bool = True) -> None:
        self.tools = tools
        self.text = ""
        self.shown_content = 0
        self.shown_reasoning = 0
        self.sent_calls = 0

    def feed(self, text: str, finished: bool) -> HarmonyOutput:
        self.text += text
        whole = messages(self.text)
        if finished and not whole:  # no message at all: the text is the content
            return HarmonyOutput(self.text)
        done = [m for m in whole if m.ended or finished]
        if whole and not (whole[-1].ended or finished):  # a marker may be arriving
            last = whole[-1]
            last.body = last.body[: len(last.body) - _partial_marker(last.body)]
        ready = HarmonyOutput()
        for m in whole:  # content and reasoning stream as they come, calls when whole
            if m.recipient is None:
                if m.channel == "analysis":
                    ready.reasoning += m.body
                else:
                    ready.content += m.body
        calls = [_call(m) for m in done if m.recipient is not None] if self.tools else []
        out = HarmonyOutput(ready.content[self.shown_content:],
                            ready.reasoning[self.shown_reasoning:], calls[self.sent_calls:])
        self.shown_content = len(ready.content)
        self.shown_reasoning = len(ready.reasoning)
        self.sent_calls = len(calls)
        return out


def _partial_marker(text: str) -> int:
    """Length of the longest tail of ``text`` that begins one of the markers."""
    for n in range(min(len(text), max(map(len, (*ENDS, START))) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in (*ENDS, START)):
            return n
    return 0
