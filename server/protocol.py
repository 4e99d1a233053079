"""OpenAI request and response bodies, fields in the order of OpenAI's reference.

Requests forbid unknown fields (a 400 that names them). Fields OpenAI defines that ringserve
does not implement are accepted only at their neutral value; anything else is refused with
the field named, never silently ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: StrictBool = False


class UnsupportedFieldError(ValueError):
    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field} {why}")
        self.field = field


# Fields OpenAI defines that ringserve accepts only at their neutral value (0, empty).
NEUTRAL_ONLY = ("suffix", "tools")


Stop = str | list[str] | None


class SamplingFields(StrictModel):
    """Fields shared by both endpoints; vLLM's extras (top_k, ignore_eos, ...) at the end."""

    seed: StrictInt | None = None
    stop: Stop = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    user: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    top_k: StrictInt = Field(0, ge=-1)
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: StrictInt = Field(0, ge=0)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values are in [-100, 100], got {bias}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Stop) -> Stop:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    max_tokens: StrictInt | None = Field(16, ge=1)
    n: StrictInt = Field(1, ge=1, le=16)
    suffix: str | None = Field(None, max_length=0)

    def check_supported(self) -> None:
        if self.echo and self.logprobs is not None:
            raise UnsupportedFieldError("echo", "with logprobs is not supported")


class ContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    n: StrictInt = Field(1, ge=1, le=16)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=0)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True

    def check_supported(self) -> None:
        if self.tool_choice not in (None, "none"):
            raise UnsupportedFieldError("tool_choice", "is not supported by ringserve")
        if self.response_format not in (None, {"type": "text"}):
            raise UnsupportedFieldError("response_format", "other than text is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "needs logprobs: true")


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[StrictInt]


# -- responses ---------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


FinishReason = Literal["stop", "length", "abort"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ringserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorInfo
