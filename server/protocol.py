"""OpenAI request and response bodies, fields in the order of OpenAI's reference.

Requests forbid unknown fields (a 400 that names them). Fields OpenAI defines that ringserve
does not implement are accepted only at their neutral value; anything else is refused with
the field named, never silently ignored.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from ringserve.server.json_values import INT64_MAX, INT64_MIN, json_value_problem, show


class StrictModel(BaseModel):
    """A part of a request: unknown fields refused, and NaN/Infinity in any float field."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FieldError(ValueError):
    """A refusal that names its field (OpenAI's ``param``), from a validator that sees more
    than one field (pydantic's own location would name the model, not the field)."""

    code: str | None = None

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedFieldError(FieldError):
    code = "unsupported_parameter"

    def __init__(self, field: str, why: str) -> None:
        super().__init__(field, f"{field} {why}")


class RequestModel(StrictModel):
    """A whole request body: its JSON values are checked once, before any field, by
    `json_value_problem` (a 400 naming the field)."""

    @model_validator(mode="before")
    @classmethod
    def _json_values(cls, data: Any) -> Any:
        problem = json_value_problem(data)
        if problem is not None:
            raise FieldError(*problem)
        return data


class StreamOptions(StrictModel):
    include_usage: StrictBool = False


# Fields OpenAI defines that ringserve accepts only at their neutral value (0, empty).
NEUTRAL_ONLY = ("suffix",)


Stop = str | list[str] | None


class JSONSchemaFormat(StrictModel):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(RequestModel):
    """Fields shared by both endpoints; vLLM's extras (top_k, ignore_eos, ...) at the end."""

    # a signed 64-bit integer, as vLLM's: torch.Generator.manual_seed takes
    # [-2**63, 2**64), and the sampler seeds choice i with seed + i
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
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
    bad_words: list[str] | None = None
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            # NOTE: ASCII digits only: str.isdigit() also takes "²", which int() refuses
            if not _TOKEN_ID.fullmatch(key) or int(key) > INT64_MAX:
                raise ValueError(f"logit_bias keys are token ids, got {show(key)}")
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


_TOKEN_ID = re.compile("[0-9]{1,19}")


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    max_tokens: StrictInt | None = Field(16, ge=1)
    n: StrictInt = Field(1, ge=1, le=16)
    suffix: str | None = Field(None, max_length=0)

    def check_supported(self) -> None:
        if self.stream and self.prompt_logprobs is not None:  # as vLLM
            raise UnsupportedFieldError("prompt_logprobs", "is not available with stream")


class ContentPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    """A message of the history; ``tool`` messages answer an assistant's ``tool_calls``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = Field(None, max_length=0)  # sent back by clients, always empty
    annotations: list[Any] | None = Field(None, max_length=0)
    # an assistant's reasoning as we answered it (a harmony model's analysis channel),
    # sent back by clients with the message; a template may show it as "thinking"
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant "
                             "message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages need tool_call_id, and only they have one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    n: StrictInt = Field(1, ge=1, le=16)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True

    def check_supported(self) -> None:
        if self.stream and self.prompt_logprobs is not None:  # as vLLM
            raise UnsupportedFieldError("prompt_logprobs", "is not available with stream")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "needs logprobs: true")


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[StrictInt]


# -- responses ---------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token under echo
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprobEntry(BaseModel):
    """vLLM's Logprob, in prompt_logprobs."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsBody = list[dict[int, PromptLogprobEntry] | None]

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobsBody | None = None  # vLLM's extra


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
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a harmony model's analysis channel (vLLM's name)


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
    prompt_logprobs: PromptLogprobsBody | None = None  # vLLM's extra


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
