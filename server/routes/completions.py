"""POST /v1/completions: plain and streaming (SSE) text completions."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ringserve.engine.outputs import prompt_logprobs_dicts
from ringserve.engine.sequence import PromptLogprob, TokenLogprob
from ringserve.server.errors import APIError, error_body, to_api_error
from ringserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobEntry,
    PromptLogprobsBody,
    Usage,
)
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

router = APIRouter()


def _prompts(req: CompletionRequest) -> list[Any]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [{"prompt_token_ids": p}]
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


# vLLM's floor for a logprob in a response (JSON has no -inf)
MIN_LOGPROB = -9999.0

Records = list[PromptLogprob | None]


def _logprobs(tokenizer: Any, lps: Sequence[TokenLogprob], offset: int) -> CompletionLogprobs:
    tokens = [tokenizer.decode([lp.token_id]) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=[{tokenizer.decode([t]): v for t, v in lp.top} for lp in lps],
        text_offset=offsets)


def _decoder(tokenizer: Any) -> Any:
    return lambda t: str(tokenizer.decode([t]))


def prompt_logprobs_body(tokenizer: Any, records: Records, k: int) -> PromptLogprobsBody:
    """vLLM's prompt_logprobs field: per prompt token null (the first) or token id ->
    {logprob, rank, decoded_token} for the token and the ``k`` likeliest at its position."""
    return [None if entry is None else {
        t: PromptLogprobEntry(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank,
                              decoded_token=lp.decoded_token) for t, lp in entry.items()}
        for entry in prompt_logprobs_dicts(records, k, _decoder(tokenizer))]


def _echo_logprobs(tokenizer: Any, prompt_ids: list[int], records: Records,
                   k: int) -> CompletionLogprobs:
    """The prompt's part of echo + logprobs, as vLLM: null for the first token, then each
    token's logprob and its position's top ``k`` with the token itself; offsets from 0
    over the tokens' texts."""
    decode = _decoder(tokenizer)
    tokens = [decode(t) for t in prompt_ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    entries = prompt_logprobs_dicts(records, k, decode)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if e is None else max(e[t].logprob, MIN_LOGPROB)
                        for t, e in zip(prompt_ids, entries, strict=True)],
        top_logprobs=[None if e is None else {
            lp.decoded_token or "": max(lp.logprob, MIN_LOGPROB) for lp in e.values()}
            for e in entries],
        text_offset=offsets)


def _end(lps: CompletionLogprobs, default: int) -> int:
    """The text offset after the last token of ``lps`` (``default`` when it has none)."""
    return lps.text_offset[-1] + len(lps.tokens[-1]) if lps.tokens else default


def _join(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


@router.post("/v1/completions", response_model=CompletionResponse, responses=SSE)
async def create_completion(req: CompletionRequest, http: HTTPRequest) -> Any:
    state = http.app.state.server
    llm = state.ready_llm()
    model = check_model(state, req.model)
    req.check_supported()
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    if req.echo and req.logprobs is not None:  # the prompt's part comes from prompt logprobs
        params = dataclasses.replace(
            params, prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0))
    prompts = _prompts(req)
    rid = request_id("cmpl")
    requests = await prepare_requests(llm, prompts, params, rid,
                                      constraint_param=_constraint_param(req))
    echoes = [(r.prompt or llm.tokenizer.decode(r.prompt_token_ids)) if req.echo else ""
              for r in requests]
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(llm, requests, req, rid, model, echoes,
                                         include_usage), media_type="text/event-stream")
    return await cancel_on_disconnect(http, _complete(llm, requests, req, rid, model, echoes))


async def _complete(llm: Any, requests: list[Any], req: CompletionRequest, rid: str,
                    model: str, echoes: list[str]) -> CompletionResponse:
    n = req.n
    texts: dict[int, str] = {}
    lps: dict[int, list[TokenLogprob]] = {}
    finish: dict[int, str | None] = {}
    usage = {}
    records: dict[int, Records] = {}
    async for i, delta in merged(llm, requests):
        if delta.prompt_logprobs is not None:
            records[i] = delta.prompt_logprobs
        for s in delta.seqs:
            k = i * n + s.index
            texts[k] = texts.get(k, echoes[i]) + s.text
            lps.setdefault(k, []).extend(s.logprobs)
            finish[k] = s.finish_reason or finish.get(k)
        usage[i] = (delta.prompt_tokens, delta.completion_tokens)
    tok = llm.tokenizer
    choices = []
    for k in sorted(texts):
        i = k // n
        logprobs = None
        if req.logprobs is not None and req.echo:
            head = _echo_logprobs(tok, requests[i].prompt_token_ids, records[i], req.logprobs)
            logprobs = _join(head, _logprobs(tok, lps[k], _end(head, 0)))
        elif req.logprobs is not None:
            logprobs = _logprobs(tok, lps[k], len(echoes[i]))
        prompt_logprobs = None if req.prompt_logprobs is None else prompt_logprobs_body(
            tok, records[i], req.prompt_logprobs)
        choices.append(CompletionChoice(index=k, text=texts[k], logprobs=logprobs,
                                        finish_reason=finish[k],  # type: ignore[arg-type]
                                        prompt_logprobs=prompt_logprobs))
    prompt_tokens = sum(p for p, _ in usage.values())
    completion_tokens = sum(c for _, c in usage.values())
    return CompletionResponse(id=rid, model=model, choices=choices,
                              usage=Usage(prompt_tokens=prompt_tokens,
                                          completion_tokens=completion_tokens,
                                          total_tokens=prompt_tokens + completion_tokens))


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(llm: Any, requests: list[Any], req: CompletionRequest, rid: str,
                  model: str, echoes: list[str], include_usage: bool) -> AsyncIterator[str]:
    created, usage, n = now(), {}, req.n
    want = requests[0].params.logprobs is not None
    echo_logprobs = want and req.echo
    tok = llm.tokenizer
    sent: dict[int, int] = {}  # text offset of the choice's next chunk
    records: dict[int, Records] = {}
    held: dict[int, list[Any]] = {}  # echo + logprobs: a choice's pieces before them
    try:
        async for i, delta in merged(llm, requests):
            usage[i] = (delta.prompt_tokens, delta.completion_tokens)
            if delta.prompt_logprobs is not None:
                records[i] = delta.prompt_logprobs
            for piece in delta.seqs:
                k = i * n + piece.index
                if echo_logprobs and i not in records:
                    held.setdefault(k, []).append(piece)
                    continue
                for s in [*held.pop(k, []), piece]:
                    text = s.text
                    logprobs = None
                    if k not in sent:
                        text = echoes[i] + text
                        sent[k] = 0
                        if echo_logprobs:
                            logprobs = _echo_logprobs(tok, requests[i].prompt_token_ids,
                                                      records[i], req.logprobs or 0)
                            sent[k] = _end(logprobs, 0)
                    if not text and s.finish_reason is None and not s.logprobs:
                        continue
                    if want:
                        tail = _logprobs(tok, s.logprobs, sent[k])
                        logprobs = tail if logprobs is None else _join(logprobs, tail)
                    if echo_logprobs and logprobs is not None:  # offsets follow the
                        sent[k] = _end(logprobs, sent[k])  # tokens' texts, as vLLM
                    else:
                        sent[k] += len(text)
                    choice = {"index": k, "text": text, "finish_reason": s.finish_reason,
                              "logprobs": None if logprobs is None else logprobs.model_dump()}
                    yield sse({"id": rid, "object": "text_completion", "created": created,
                               "model": model, "choices": [choice]})
        if include_usage:
            yield sse(_usage_chunk(rid, "text_completion", created, model, usage))
    except Exception as err:
        api = to_api_error(err)
        yield sse(error_body(api.status, api.message, api.param, api.code))
    yield "data: [DONE]\n\n"


def _usage_chunk(rid: str, obj: str, created: int, model: str,
                 usage: dict[int, tuple[int, int]]) -> dict[str, Any]:
    p = sum(a for a, _ in usage.values())
    c = sum(b for _, b in usage.values())
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}


def _constraint_param(req: CompletionRequest) -> str | None:
    return "response_format" if req.structured_outputs is None else None
