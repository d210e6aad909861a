"""OpenAI request bodies (pydantic): /v1/completions, /v1/chat/completions, and POST /admin/morph.

These models check shapes only: types are strict ("0.5" is not a number), strings must be valid
Unicode text (a lone surrogate such as "\\ud800" is refused here, naming the field), unknown fields
are ignored as OpenAI and vLLM do. What a value means (ranges, sampling semantics) is checked once,
by engine/sampling_params.py. Features the engine does not have (n > 1, best_of, logprobs, tools,
penalties) are refused with a message that names them rather than silently ignored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from deployments.protocol.errors import UnsupportedFeature


def _unicode_text(value: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer or UTF-8 encoder accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: a lone surrogate at character {e.start}") from None
    return value


Text = Annotated[str, AfterValidator(_unicode_text)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields /v1/completions and /v1/chat/completions share (OpenAI names, plus vLLM's top_k,
    stop_token_ids and ignore_eos)."""
    model_config = ConfigDict(strict=True, extra="ignore")

    model: Text
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM extension; -1 or 0 = disabled")
    seed: int | None = None
    stop: list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: Text | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str) else v  # OpenAI: a string or a list of strings
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise ValueError("stop must be a string or a list of strings")
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
            fields["top_k"] = self.top_k
        return fields

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[int]
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
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

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
    max_completion_tokens: int | None = None
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
    quantized_layers: int | None = None  # its range (0..layers) is the replica's to check
    precision: Literal["int8", "int4"] | None = None
