"""POST /v1/completions: plain and streaming (SSE) text completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from engine.sequence import TokenLogprob
from server.errors import APIError, error_body, to_api_error
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from server.serving import (
    SSE,
    cancel_on_disconnect,
    check_model,
    merged,
    now,
    prepare_all,
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


@router.post("/v1/completions", response_model=CompletionResponse, responses=SSE)
async def create_completion(req: CompletionRequest, http: HTTPRequest) -> Any:
    state = http.app.state.server
    llm = state.ready_llm()
    model = check_model(state, req.model)
    req.check_supported()
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    prompts = _prompts(req)
    rid = request_id("cmpl")
    requests = prepare_all(llm, prompts, params, rid)
    echoes = [(r.prompt or llm.engine.tokenizer.decode(r.prompt_token_ids)) if req.echo else ""
              for r in requests]
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(llm, requests, req.n, rid, model, echoes,
                                         include_usage), media_type="text/event-stream")
    return await cancel_on_disconnect(http, _complete(llm, requests, req.n, rid, model, echoes))


async def _complete(llm: Any, requests: list[Any], n: int, rid: str, model: str,
                    echoes: list[str]) -> CompletionResponse:
    texts: dict[int, str] = {}
    lps: dict[int, list[TokenLogprob]] = {}
    finish: dict[int, str | None] = {}
    usage = {}
    async for i, delta in merged(llm, requests):
        for s in delta.seqs:
            k = i * n + s.index
            texts[k] = texts.get(k, echoes[i]) + s.text
            lps.setdefault(k, []).extend(s.logprobs)
            finish[k] = s.finish_reason or finish.get(k)
        usage[i] = (delta.prompt_tokens, delta.completion_tokens)
    want = requests[0].params.logprobs is not None
    tok = llm.engine.tokenizer
    choices = [CompletionChoice(index=k, text=texts[k], finish_reason=finish[k],  # type: ignore[arg-type]
                                logprobs=_logprobs(tok, lps[k], len(echoes[k // n]))
                                if want else None)
               for k in sorted(texts)]
    prompt_tokens = sum(p for p, _ in usage.values())
    completion_tokens = sum(c for _, c in usage.values())
    return CompletionResponse(id=rid, model=model, choices=choices,
                              usage=Usage(prompt_tokens=prompt_tokens,
                                          completion_tokens=completion_tokens,
                                          total_tokens=prompt_tokens + completion_tokens))


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(llm: Any, requests: list[Any], n: int, rid: str, model: str,
                  echoes: list[str], include_usage: bool) -> AsyncIterator[str]:
    created, usage = now(), {}
    want = requests[0].params.logprobs is not None
    tok = llm.engine.tokenizer
    sent: dict[int, int] = {}
    try:
        async for i, delta in merged(llm, requests):
            usage[i] = (delta.prompt_tokens, delta.completion_tokens)
            for s in delta.seqs:
                k = i * n + s.index
                text = s.text
                if k not in sent:
                    text = echoes[i] + text
                    sent[k] = 0
                if not text and s.finish_reason is None and not s.logprobs:
                    continue
                choice = {"index": k, "text": text, "finish_reason": s.finish_reason,
                          "logprobs": _logprobs(tok, s.logprobs, sent[k]).model_dump()
                          if want else None}
                sent[k] += len(text)
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
