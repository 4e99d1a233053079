"""GET /v1/models, /health, /version, /v1/admission; POST /tokenize, /detokenize."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from ringserve.block_manager import admission
from ringserve.server.errors import APIError
from ringserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from ringserve.server.routes.chat import chat_prompt_ids
from ringserve.server.serving import check_model
from ringserve.server.state import Phase

router = APIRouter()
VERSION = "0.1.0"
NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {"model": ErrorResponse, "description": "starting or stopping"}}


@router.get("/v1/models", response_model=ModelList)
async def list_models(http: HTTPRequest) -> ModelList:
    state = http.app.state.server
    llm = state.ready_llm()
    return ModelList(data=[ModelCard(id=state.model_name, created=state.created,
                                     max_model_len=llm.limits.max_model_len)])


@router.get("/health", responses=NOT_READY)
async def health(http: HTTPRequest) -> JSONResponse:
    """200 once the model is loaded and the engine loop runs; 503 before and after."""
    state = http.app.state.server
    ok = state.phase is Phase.READY and state.llm is not None and state.llm.dead is None
    body = {"status": state.phase.value if ok or state.phase is not Phase.READY else "failed"}
    if state.error:
        body["error"] = state.error
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": VERSION}


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(req: TokenizeRequest, http: HTTPRequest) -> TokenizeResponse:
    state = http.app.state.server
    llm = state.ready_llm()
    check_model(state, req.model)
    tokenizer = llm.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if req.messages is not None:
        ids = chat_prompt_ids(tokenizer, req.messages, req.add_generation_prompt)
    else:
        ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    return TokenizeResponse(count=len(ids), max_model_len=llm.limits.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(req: DetokenizeRequest, http: HTTPRequest) -> DetokenizeResponse:
    state = http.app.state.server
    llm = state.ready_llm()
    check_model(state, req.model)
    vocab = llm.limits.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
    text: Any = llm.tokenizer.decode(req.tokens)
    return DetokenizeResponse(prompt=str(text))


@router.get("/v1/admission")
async def admission_answer(http: HTTPRequest, prompt_tokens: int | None = None,
                           max_tokens: int | None = None) -> dict[str, Any]:
    """Would a request of this shape be admitted now, how many fit now and in an empty
    pool: exact, since admission is (`block_manager.budget.admission`), for a request with
    no prefix hit. Read from the engine's last published snapshot."""
    state = http.app.state.server
    llm = state.ready_llm()
    for name, value in (("prompt_tokens", prompt_tokens), ("max_tokens", max_tokens)):
        if value is None or value < 1:
            raise APIError(400, f"{name} must be an integer >= 1", param=name)
    assert prompt_tokens is not None and max_tokens is not None
    limit = llm.limits.max_model_len
    if prompt_tokens + max_tokens > limit:
        raise APIError(400, f"prompt_tokens + max_tokens = {prompt_tokens + max_tokens} "
                       f"exceeds max_model_len {limit}", param="max_tokens")
    snapshot = llm.stats()["admission_state"]
    answer = admission(llm.limits.spec, snapshot, prompt_tokens, max_tokens)
    return answer.body(snapshot)
