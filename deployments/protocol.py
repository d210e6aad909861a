"""OpenAI-compatible request and response bodies (pydantic) and the OpenAI error body.

Requests are strict about types ("0.5" is not a number) and ignore unknown fields, as OpenAI and
vLLM do; features the engine does not have (n > 1, best_of, logprobs, tools, penalties) are refused
with a message that names them rather than silently ignored.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from deployments.engine_client import GenerateChunk
from engine.outputs import FinishReason

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 500: "server_error", 503: "overloaded_error"}



def _unix_now() -> int:
    """OpenAI's `created`: unix seconds."""
    return int(time.time())

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    detail = ErrorDetail(message=message, type=ERROR_TYPES.get(status, "server_error"), param=param,
                         code=code if code is not None else status)
    return ErrorResponse(error=detail).model_dump()


class UnsupportedFeature(ValueError):
    """A well-formed request asks for something this server does not do (-> 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# ---- requests ----------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields /v1/completions and /v1/chat/completions share (OpenAI names, plus vLLM's top_k,
    stop_token_ids and ignore_eos)."""
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, description="vLLM extension; -1 or 0 = disabled")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("top_k must be -1 or 0 (disabled) or >= 1")
        return v

    def check_supported(self) -> None:
        """Raise UnsupportedFeature for what the engine cannot do."""
        if self.n != 1:
            raise UnsupportedFeature("n > 1 is not supported; send one request per completion", "n")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFeature("stream_options is only allowed when stream is true", "stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise UnsupportedFeature(f"{name} is not supported; leave it at 0", name)
        if self.logit_bias:
            raise UnsupportedFeature("logit_bias is not supported", "logit_bias")

    def sampling_fields(self) -> dict[str, Any]:
        """GenerateRequest fields other than request_id, prompt and max_tokens."""
        fields: dict[str, Any] = {"stop": tuple(self.stop or ()), "stop_token_ids": tuple(self.stop_token_ids or ()),
                                  "ignore_eos": self.ignore_eos, "seed": self.seed}
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        if self.top_k is not None:
            fields["top_k"] = -1 if self.top_k in (-1, 0) else self.top_k
        return fields

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        # OpenAI also allows a batch (a list of prompts); one prompt per request here.
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, list) and any(isinstance(x, (str, list)) for x in v):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        if isinstance(v, str) or (isinstance(v, list) and all(type(x) is int for x in v)):
            if len(v) == 0:
                raise ValueError("prompt is empty; send a non-empty string or list of token ids")
            return v
        raise ValueError("prompt must be a string or a list of token ids")

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise UnsupportedFeature("best_of is not supported", "best_of")
        if self.logprobs is not None:
            raise UnsupportedFeature("logprobs are not supported", "logprobs")
        if self.echo:
            raise UnsupportedFeature("echo is not supported", "echo")
        if self.suffix:
            raise UnsupportedFeature("suffix is not supported", "suffix")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("content parts must be {'type': 'text', 'text': '...'}; only text is supported")
            return v
        if not isinstance(v, str):
            raise ValueError("content must be a string or a list of text parts")
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise UnsupportedFeature("logprobs are not supported", "logprobs")
        if self.tools:
            raise UnsupportedFeature("tools are not supported", "tools")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class MorphAdminRequest(BaseModel):
    """POST /admin/morph. Our own API, so unknown fields are an error (a typo must not pass)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    mode: Literal["accuracy", "balanced", "performance"] | None = None
    morphing_enabled: bool | None = None
    quantized_layers: int | None = Field(None, ge=0)
    precision: Literal["int8", "int4"] | None = None


# ---- responses ---------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """Both the whole answer and a stream chunk (OpenAI uses the same object type for both)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_unix_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):  # OpenAI sends {"content": "..."} and a final {}, not nulls
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_unix_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "morphserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- engine chunks -> OpenAI bodies (the ingress streams or collects, these only format) --------

def completion_body(rid: str, model: str, text: str, last: GenerateChunk) -> dict:
    choice = CompletionChoice(text=text, finish_reason=last.finish_reason or "abort")
    usage = Usage.of(last.num_prompt_tokens, last.num_output_tokens)
    return CompletionResponse(id=rid, model=model, choices=[choice], usage=usage).model_dump()


def chat_body(rid: str, model: str, text: str, last: GenerateChunk) -> dict:
    choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=last.finish_reason or "abort")
    usage = Usage.of(last.num_prompt_tokens, last.num_output_tokens)
    return ChatCompletionResponse(id=rid, model=model, choices=[choice], usage=usage).model_dump()


def completion_stream_renderer(rid: str, model: str, include_usage: bool) -> Callable[[GenerateChunk], list[dict]]:
    created = int(time.time())
    exclude = None if include_usage else {"usage"}  # OpenAI: "usage": null on every chunk only when asked

    def render(chunk: GenerateChunk) -> list[dict]:
        out = []
        if chunk.text or chunk.finish_reason:
            choice = CompletionChoice(text=chunk.text, finish_reason=chunk.finish_reason)
            out.append(CompletionResponse(id=rid, created=created, model=model, choices=[choice]).model_dump(exclude=exclude))
        if chunk.finish_reason and include_usage:
            usage = Usage.of(chunk.num_prompt_tokens, chunk.num_output_tokens)
            out.append(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage).model_dump())
        return out

    return render


def chat_stream_renderer(rid: str, model: str, include_usage: bool) -> Callable[[GenerateChunk], list[dict]]:
    """First chunk: the assistant role; then content deltas; then an empty delta with finish_reason;
    then, when asked, a chunk with no choices and the usage (OpenAI's order)."""
    created, started = int(time.time()), [False]
    exclude = None if include_usage else {"usage"}

    def make(delta: ChatDelta | None, finish: str | None = None, usage: Usage | None = None) -> dict:
        choices = [] if delta is None else [ChatStreamChoice(delta=delta, finish_reason=finish)]
        chunk = ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage)
        return chunk.model_dump(exclude=None if usage else exclude)

    def render(chunk: GenerateChunk) -> list[dict]:
        out = []
        if not started[0]:
            started[0] = True
            out.append(make(ChatDelta(role="assistant", content="")))
        if chunk.text:
            out.append(make(ChatDelta(content=chunk.text)))
        if chunk.finish_reason:
            out.append(make(ChatDelta(), chunk.finish_reason))
            if include_usage:
                out.append(make(None, usage=Usage.of(chunk.num_prompt_tokens, chunk.num_output_tokens)))
        return out

    return render
