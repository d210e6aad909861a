"""OpenAI request bodies (pydantic): /v1/completions, /v1/chat/completions, and POST /admin/morph.

These models check shapes only: types are strict ("0.5" is not a number), strings must be valid
Unicode text (a lone surrogate such as "\\ud800" is refused here, naming the field), unknown fields
are ignored as OpenAI and vLLM do. What a value means (ranges, sampling semantics) is checked once,
by engine/sampling_params.py.

Unknown fields are accepted and logged (`ignored_fields`), as vLLM does. Fields OpenAI or vLLM
define that this server cannot honour are refused with a 400 naming them (`REFUSED`), never
dropped: a client that asks for tool calls or beam search must learn that it did not get them.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from deployments.protocol.errors import UnsupportedFeature
from engine.sampling_params import StructuredOutput

# Known fields we cannot honour -> why. Refused when present with a value other than "off".
REFUSED: dict[str, str] = {
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "suffix": "suffix (insertion) is not supported",
    "use_beam_search": "beam search is not supported",
    "best_of": "best_of is not supported (use n)",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "guided_json": "use response_format json_schema instead",
    "guided_regex": "regex-guided decoding is not supported",
    "guided_choice": "choice-guided decoding is not supported",
    "guided_grammar": "grammar-guided decoding is not supported",
    "structured_outputs": "use response_format json_schema instead",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "bad_words": "bad_words is not supported",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "truncate_prompt_tokens": "prompt truncation is not supported",
    "chat_template": "a per-request chat template is not supported",
    "continue_final_message": "continue_final_message is not supported",
    "include_stop_str_in_output": "include_stop_str_in_output is not supported",
    "skip_special_tokens": "only skip_special_tokens=true is supported",
}
_OFF_VALUES: dict[str, tuple] = {"tools": (None, []), "parallel_tool_calls": (None, False, True),
                                 "best_of": (None, 1), "use_beam_search": (None, False),
                                 "length_penalty": (None, 1, 1.0), "modalities": (None, ["text"]),
                                 "continue_final_message": (None, False), "include_stop_str_in_output": (None, False),
                                 "skip_special_tokens": (None, True), "function_call": (None, "none")}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: Text = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: Text | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.json_schema is None:
            raise UnsupportedFeature("response_format of type json_schema needs a json_schema object",
                                     "response_format")
        return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_))


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
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: logged by the ingress

    model: Text | None = None  # optional: one model is served
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
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    tool_choice: Any = None
    user: Text | None = None
    # vLLM's: salts the prefix cache's keys, so only requests with the same salt share cached blocks (a
    # tenant's secret: others cannot learn by timing whether a prompt of theirs is cached)
    cache_salt: Text | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str) else v  # OpenAI: a string or a list of strings
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise ValueError("stop must be a string or a list of strings")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string (or left out)")
        return v

    def check_supported(self) -> None:
        """Raise UnsupportedFeature for a known field we cannot honour."""
        if self.n < 1:
            raise UnsupportedFeature(f"n must be >= 1, got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFeature("stream_options is only allowed when stream is true", "stream_options")
        if self.tool_choice not in (None, "none"):
            raise UnsupportedFeature("tool_choice other than 'none' is not supported (no tool calling)", "tool_choice")
        extra = self.model_extra or {}
        for name, why in REFUSED.items():
            if name in extra and extra[name] not in _OFF_VALUES.get(name, (None,)):
                raise UnsupportedFeature(f"{name}: {why}", name)

    def ignored_fields(self) -> list[str]:
        """Unknown fields (accepted, not used: the ingress logs them, as vLLM does)."""
        return sorted(k for k in (self.model_extra or {}) if k not in REFUSED)

    def sampling_fields(self) -> dict[str, Any]:
        """GenerateRequest fields other than request_id, prompt and max_tokens."""
        bias = tuple(sorted((_token_id(k), v) for k, v in (self.logit_bias or {}).items()))
        fields: dict[str, Any] = {"stop": tuple(self.stop or ()), "stop_token_ids": tuple(self.stop_token_ids or ()),
                                  "ignore_eos": self.ignore_eos, "seed": self.seed,
                                  "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                                  "repetition_penalty": self.repetition_penalty, "min_p": self.min_p,
                                  "min_tokens": self.min_tokens, "logit_bias": bias, "cache_salt": self.cache_salt,
                                  "structured_output": self.response_format.structured_output()
                                  if self.response_format else None}
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


def _token_id(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise UnsupportedFeature(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM extension

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        # one prompt (a string or token ids) or a batch of them (a list of strings / of token-id lists)
        one = lambda x: isinstance(x, str) or (isinstance(x, list) and all(type(t) is int for t in x))  # noqa: E731
        if not (one(v) or (isinstance(v, list) and v and all(one(x) and not isinstance(x, int) for x in v))):
            raise ValueError("prompt must be a string, a list of token ids, or a list of either")
        if len(v) == 0 or (isinstance(v, list) and any(isinstance(x, (str, list)) and len(x) == 0 for x in v)):
            raise ValueError("prompt is empty; send a non-empty string or list of token ids")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt."""
        if isinstance(self.prompt, str) or all(type(t) is int for t in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def logprob_fields(self) -> dict[str, Any]:
        prompt_lps = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_lps is None:
            prompt_lps = self.logprobs  # echo + logprobs: the prompt's logprobs too (lm-eval's loglikelihood)
        return {"logprobs": self.logprobs, "prompt_logprobs": prompt_lps}


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

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFeature("top_logprobs needs logprobs: true", "top_logprobs")
        if (self.model_extra or {}).get("echo"):
            raise UnsupportedFeature("echo: echoing the conversation is not supported on chat", "echo")

    def logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None, "prompt_logprobs": None}

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt (BOS added as for /v1/completions unless add_special_tokens
    is false) or chat messages (through the chat template)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: Text | None = None
    tokens: list[int]


class MorphAdminRequest(BaseModel):
    """POST /admin/morph. Our own API, so unknown fields are an error (a typo must not pass)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    mode: Literal["accuracy", "balanced", "performance"] | None = None
    morphing_enabled: bool | None = None
    quantized_layers: int | None = None  # its range (0..layers) is the replica's to check
    precision: Literal["int8", "int4"] | None = None
