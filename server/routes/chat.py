"""POST /v1/chat/completions: the tokenizer's chat template, plain and streaming."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ringserve.engine.sequence import TokenLogprob
from ringserve.server.errors import APIError, error_body, to_api_error
from ringserve.server.harmony import HarmonyStream, is_harmony, parse_harmony
from ringserve.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    NamedToolChoice,
    Tool,
    ToolCall,
    TopLogprob,
    Usage,
)
from ringserve.server.routes.completions import prompt_logprobs_body
from ringserve.server.serving import (
    SSE,
    cancel_on_disconnect,
    check_model,
    merged,
    now,
    prepare_requests,
    request_id,
    sampling_params,
)
from ringserve.server.tools import (
    ChoiceCalls,
    render_messages,
    template_knows_tools,
    tool_choice,
    tool_constraint,
)

router = APIRouter()


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage],
                    add_generation_prompt: bool, tools: Sequence[Tool] | None = None
                    ) -> list[int]:
    """Render the chat template and tokenize it (special tokens come from the template);
    tools and tool messages as `server.tools.render_messages` writes them."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions",
                       param="messages", code="no_chat_template")
    native = template_knows_tools(tokenizer)
    history, tool_list = render_messages(messages, tools, native)
    try:
        rendered = tokenizer.apply_chat_template(
            history, tools=tool_list, tokenize=False,
            add_generation_prompt=add_generation_prompt)
    except Exception as err:  # a template may refuse an order of roles, say
        raise APIError(400, f"the chat template rejected these messages: {err}",
                       param="messages", code="chat_template_error") from None
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def _token_logprob(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    text = tokenizer.decode([token_id])
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def _logprobs(tokenizer: Any, lps: Sequence[TokenLogprob]) -> ChatLogprobs:
    content = []
    for lp in lps:
        head = _token_logprob(tokenizer, lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(
            **head.model_dump(),
            top_logprobs=[_token_logprob(tokenizer, t, v) for t, v in lp.top]))
    return ChatLogprobs(content=content)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=SSE)
async def create_chat_completion(req: ChatCompletionRequest, http: HTTPRequest) -> Any:
    state = http.app.state.server
    llm = state.ready_llm()
    model = check_model(state, req.model)
    req.check_supported()
    tokenizer = llm.tokenizer
    choice = tool_choice(req, state.args.tool_call_parser)
    ids = chat_prompt_ids(tokenizer, req.messages, req.add_generation_prompt,
                          None if choice == "none" else req.tools)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    constraint = None if choice in ("none", "auto") else tool_constraint(req, choice)
    params = sampling_params(req, max_tokens=req.max_completion_tokens or req.max_tokens,
                             logprobs=logprobs, constraint=constraint)
    # gpt-oss answers in harmony messages, read out of the text with its special tokens;
    # a required or named choice generates the constrained JSON instead
    harmony = choice in ("none", "auto") and (
        state.args.tool_call_parser == "openai" or is_harmony(tokenizer))
    if choice == "auto" or harmony:  # a tool-call tag may be a special token: keep it
        params = dataclasses.replace(params, skip_special_tokens=False)
    rid = request_id("chatcmpl")
    requests = await prepare_requests(
        llm, [{"prompt_token_ids": ids}], params, rid,
        constraint_param="tools" if constraint is not None else
        None if req.structured_outputs is not None else "response_format")
    tools = None if choice == "none" else choice
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(llm, requests, rid, model, include_usage, tools,
                                         harmony=harmony),
                                 media_type="text/event-stream")
    return await cancel_on_disconnect(http, _complete(llm, requests, rid, model, tools,
                                                      harmony=harmony))


def _message(text: str, finish: str | None, tools: str | NamedToolChoice | None,
             harmony: bool = False) -> tuple[ChatResponseMessage, str | None]:
    if harmony:
        out = parse_harmony(text, tools=tools == "auto")
        return ChatResponseMessage(
            content=out.content or (None if out.calls else ""),
            tool_calls=[ToolCall.model_validate(c.body()) for c in out.calls] or None,
            reasoning_content=out.reasoning or None,
        ), "tool_calls" if out.calls and finish == "stop" else finish
    if tools is None:
        return ChatResponseMessage(content=text), finish
    content, calls, finish = ChoiceCalls(tools).whole(text, finish)
    return ChatResponseMessage(
        content=content,
        tool_calls=[ToolCall.model_validate(c.body()) for c in calls] if calls else None,
    ), finish


async def _complete(llm: Any, requests: list[Any], rid: str, model: str,
                    tools: str | NamedToolChoice | None = None, *,
                    harmony: bool = False) -> ChatCompletionResponse:
    texts: dict[int, str] = {}
    lps: dict[int, list[TokenLogprob]] = {}
    finish: dict[int, str | None] = {}
    prompt_tokens = completion_tokens = 0
    records = None
    async for _, delta in merged(llm, requests):
        for s in delta.seqs:
            texts[s.index] = texts.get(s.index, "") + s.text
            lps.setdefault(s.index, []).extend(s.logprobs)
            finish[s.index] = s.finish_reason or finish.get(s.index)
        prompt_tokens, completion_tokens = delta.prompt_tokens, delta.completion_tokens
        records = delta.prompt_logprobs if delta.prompt_logprobs is not None else records
    want = requests[0].params.logprobs is not None
    tok = llm.tokenizer
    choices = []
    for k in sorted(texts):
        message, reason = _message(texts[k], finish[k], tools, harmony)
        choices.append(ChatChoice(index=k, message=message,
                                  finish_reason=reason,  # type: ignore[arg-type]
                                  logprobs=_logprobs(tok, lps[k]) if want else None))
    return ChatCompletionResponse(
        id=rid, model=model, choices=choices,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens),
        prompt_logprobs=None if records is None else prompt_logprobs_body(
            tok, records, requests[0].params.prompt_logprobs))


def _chunk(rid: str, created: int, model: str, choices: list[dict[str, Any]],
           usage: dict[str, int] | None = None) -> str:
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _stream(llm: Any, requests: list[Any], rid: str, model: str,
                  include_usage: bool, tools: str | NamedToolChoice | None = None, *,
                  harmony: bool = False) -> AsyncIterator[str]:
    created = now()
    want = requests[0].params.logprobs is not None
    tok = llm.tokenizer
    started: set[int] = set()
    calls: dict[int, ChoiceCalls] = {}
    readers: dict[int, HarmonyStream] = {}
    sent: dict[int, int] = {}  # harmony calls streamed per choice
    usage = (0, 0)
    try:
        async for _, delta in merged(llm, requests):
            usage = (delta.prompt_tokens, delta.completion_tokens)
            for s in delta.seqs:
                if s.index not in started:
                    started.add(s.index)
                    yield _chunk(rid, created, model, [{
                        "index": s.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}])
                text, reason = s.text, s.finish_reason
                body: dict[str, Any] = {}
                if harmony:
                    harmony_reader = readers.setdefault(s.index,
                                                        HarmonyStream(tools=tools == "auto"))
                    out = harmony_reader.feed(text, reason is not None)
                    text = out.content
                    if out.reasoning:
                        body["reasoning_content"] = out.reasoning
                    if out.calls:
                        first = sent.get(s.index, 0)
                        body["tool_calls"] = [c.body(first + i) for i, c in
                                              enumerate(out.calls)]
                        sent[s.index] = first + len(out.calls)
                    if reason == "stop" and sent.get(s.index):
                        reason = "tool_calls"
                elif tools is not None:
                    reader = calls.setdefault(s.index, ChoiceCalls(tools))
                    text, tool_deltas = reader.feed(text, reason is not None)
                    reason = reader.finish_reason(reason)
                    if tool_deltas:
                        body["tool_calls"] = tool_deltas
                if text:
                    body["content"] = text
                if not body and reason is None and not s.logprobs:
                    continue
                choice = {"index": s.index, "delta": body, "finish_reason": reason,
                          "logprobs": _logprobs(tok, s.logprobs).model_dump() if want else None}
                yield _chunk(rid, created, model, [choice])
        if include_usage:
            p, c = usage
            yield _chunk(rid, created, model, [],
                         {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
    except Exception as err:
        api = to_api_error(err)
        yield f"data: {json.dumps(error_body(api.status, api.message, api.param, api.code))}\n\n"
    yield "data: [DONE]\n\n"
