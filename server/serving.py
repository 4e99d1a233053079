"""Shared request handling: model names, sampling params, running and merging streams."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request as HTTPRequest

from ringserve.engine import InvalidRequestError, SamplingParams, StructuredOutputsParams
from ringserve.engine.async_llm import EngineFront, StreamDelta
from ringserve.engine.request_check import CheckedRequest
from ringserve.server.errors import APIError
from ringserve.server.protocol import ChatCompletionRequest, CompletionRequest
from ringserve.server.state import ServerState

SSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when streaming"}}
"""The OpenAPI response of the two generation routes: JSON, or SSE when streaming."""


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:20]}"


def check_model(state: ServerState, model: str | None) -> str:
    """The served name, or a 404 naming the unknown model."""
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{state.model_name!r}", param="model", code="model_not_found")
    return state.model_name


def structured_outputs(req: CompletionRequest | ChatCompletionRequest
                       ) -> StructuredOutputsParams | None:
    """The output constraint of ``response_format`` (OpenAI) or ``structured_outputs``
    (vLLM), at most one of them."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise APIError(400, "give response_format or structured_outputs, not both",
                       param="structured_outputs")
    if so is not None:
        return StructuredOutputsParams(json=so.json_, json_object=bool(so.json_object),
                                       regex=so.regex, choice=so.choice, grammar=so.grammar)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    assert fmt.json_schema is not None
    schema = fmt.json_schema.schema_
    if schema is None:
        raise APIError(400, "response_format.json_schema.schema is required",
                       param="response_format")
    return StructuredOutputsParams(json=schema)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
                    logprobs: int | None,
                    constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    """The one conversion point from an API body to engine SamplingParams (``constraint``:
    one that replaces the request's own, from a tool choice)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        n=req.n, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, seed=req.seed, stop=stop, stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos, logprobs=logprobs,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, min_p=req.min_p, min_tokens=req.min_tokens,
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()} or None,
        bad_words=req.bad_words, prompt_logprobs=req.prompt_logprobs,
        structured_outputs=constraint or structured_outputs(req))


def prepare_all(llm: EngineFront, prompts: Sequence[Any], params: SamplingParams,
                base_id: str) -> list[CheckedRequest]:
    """Check every prompt before any is queued, so a bad one leaves nothing running, and
    the room the request's sequences take in the waiting queue, all of them together."""
    requests = [llm.prepare(p, params, f"{base_id}-{i}") for i, p in enumerate(prompts)]
    llm.check_room(requests)
    return requests


async def prepare_requests(llm: EngineFront, prompts: Sequence[Any], params: SamplingParams,
                           base_id: str, *, constraint_param: str | None = None
                           ) -> list[CheckedRequest]:
    """`prepare_all`; under structured outputs in a worker thread (a new schema compiles
    there, not in the event loop), its errors named after the field the constraint came
    from (``constraint_param``: ``response_format``, or ``tools`` whose parameters a
    required or named tool choice generates under)."""
    if params.structured_outputs is None:
        return prepare_all(llm, prompts, params, base_id)
    try:
        return await asyncio.to_thread(prepare_all, llm, prompts, params, base_id)
    except InvalidRequestError as err:
        if constraint_param and (err.param or "").startswith("structured_outputs"):
            raise InvalidRequestError(str(err).replace("structured_outputs.json",
                                                       constraint_param),
                                      param=constraint_param) from None
        raise


async def merged(llm: EngineFront,
                 requests: Sequence[CheckedRequest]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Run prepared requests and yield (request index, delta) as they come.

    Leaving early (a disconnect) closes every stream, which aborts its engine request.
    """
    if len(requests) == 1:
        # NOTE: one stream (most requests) is read here, not through a task and a queue:
        # a token then wakes one task fewer in this process, which shares the CPUs with
        # the engine core's threads
        stream = llm.stream(requests[0])
        try:
            async for delta in stream:
                yield 0, delta
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, request: CheckedRequest) -> None:
        try:
            async for delta in llm.stream(request):
                await queue.put((i, delta))
        except BaseException as err:
            await queue.put((i, err))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(http: HTTPRequest) -> None:
    """Return once the client has gone away (polls; for non-streaming requests)."""
    while not await http.is_disconnected():
        await asyncio.sleep(0.5)


async def cancel_on_disconnect(http: HTTPRequest, work: Any) -> Any:
    """Await ``work``; if the client leaves first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(http))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client disconnected")
    finally:
        watcher.cancel()


def now() -> int:
    return int(time.time())
