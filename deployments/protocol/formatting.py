"""Engine chunks -> OpenAI bodies: the whole answer, and stream chunks in OpenAI's order (the
ingress streams or collects; these only format).

A request fans out to several engine requests (n choices per prompt, several prompts): choice
index = prompt index x n + j, as vLLM numbers them. Usage counts each prompt once and every
choice's tokens.
"""
from __future__ import annotations

import dataclasses
import time

from deployments.engine_client import GenerateChunk
from deployments.protocol.logprobs import chat_logprobs, completion_logprobs
from deployments.protocol.responses import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionResponse,
                                            ChatDelta, ChatStreamChoice, CompletionChoice, CompletionResponse, Usage)


@dataclasses.dataclass
class Choice:
    """One choice as it is collected (non-streaming) or streamed."""
    index: int
    echo: str = ""  # completions with echo: the prompt text, sent before the generated text
    first_token: str = ""  # the first prompt token's text (echo + logprobs)
    text: str = ""
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False
    text_offset: int = 0  # characters sent so far (completion logprobs' text_offset)

    def add(self, chunk: GenerateChunk) -> None:
        self.text += chunk.text
        if chunk.prompt_logprobs is not None:
            self.logprobs.extend(chunk.prompt_logprobs)
        if chunk.logprobs is not None:
            self.logprobs.extend(chunk.logprobs)
        self.finish_reason = chunk.finish_reason or self.finish_reason


def usage_of(prompt_tokens: list[int], chunks_by_choice: dict[int, GenerateChunk]) -> Usage:
    """Each prompt counts once, however many choices it has (choice index = prompt * n + j), and so do its
    cached tokens: its first choice's (later choices may find it cached because of the first)."""
    n = max(1, len(chunks_by_choice) // max(1, len(prompt_tokens)))
    firsts = [chunks_by_choice[k * n] for k in range(len(prompt_tokens)) if k * n in chunks_by_choice]
    return Usage.of(sum(prompt_tokens), sum(c.num_output_tokens for c in chunks_by_choice.values()),
                    sum(c.num_cached_tokens for c in firsts))


class CompletionFormatter:
    def __init__(self, rid: str, model: str, include_usage: bool, want_logprobs: bool):
        self.rid, self.model, self.want_logprobs = rid, model, want_logprobs
        self.created = int(time.time())
        self.exclude = None if include_usage else {"usage"}  # OpenAI: "usage": null on chunks only when asked

    def _logprobs(self, c: Choice, positions: list, offset: int) -> dict | None:
        return completion_logprobs(positions, offset, c.first_token) if self.want_logprobs else None

    def body(self, choices: list[Choice], usage: Usage) -> dict:
        out = [CompletionChoice(index=c.index, text=c.echo + c.text, finish_reason=c.finish_reason or "abort",
                                logprobs=self._logprobs(c, c.logprobs, 0)) for c in choices]
        return CompletionResponse(id=self.rid, model=self.model, choices=out, usage=usage).model_dump()

    def stream(self, c: Choice, chunk: GenerateChunk) -> list[dict]:
        text = chunk.text if c.started else c.echo + chunk.text
        c.started = True
        positions = list(chunk.prompt_logprobs or ()) + list(chunk.logprobs or ())
        if not (text or chunk.finish_reason or positions):
            return []
        choice = CompletionChoice(index=c.index, text=text, finish_reason=chunk.finish_reason,
                                  logprobs=self._logprobs(c, positions, c.text_offset))
        c.text_offset += len(text)
        return [CompletionResponse(id=self.rid, created=self.created, model=self.model,
                                   choices=[choice]).model_dump(exclude=self.exclude)]

    def usage_chunk(self, usage: Usage) -> dict:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[],
                                  usage=usage).model_dump()


class ChatFormatter:
    """Stream: per choice, first the assistant role, then content deltas, then an empty delta with
    finish_reason; at the very end, when asked, a chunk with no choices and the usage (OpenAI's order)."""

    def __init__(self, rid: str, model: str, include_usage: bool, want_logprobs: bool):
        self.rid, self.model, self.want_logprobs = rid, model, want_logprobs
        self.created = int(time.time())
        self.exclude = None if include_usage else {"usage"}

    def body(self, choices: list[Choice], usage: Usage) -> dict:
        out = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason or "abort",
                          logprobs=chat_logprobs(c.logprobs) if self.want_logprobs else None) for c in choices]
        return ChatCompletionResponse(id=self.rid, model=self.model, choices=out, usage=usage).model_dump()

    def _make(self, choice: ChatStreamChoice | None, usage: Usage | None = None) -> dict:
        chunk = ChatCompletionChunk(id=self.rid, created=self.created, model=self.model,
                                    choices=[] if choice is None else [choice], usage=usage)
        return chunk.model_dump(exclude=None if usage else self.exclude)

    def stream(self, c: Choice, chunk: GenerateChunk) -> list[dict]:
        out = []
        if not c.started:
            c.started = True
            out.append(self._make(ChatStreamChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))))
        lps = chat_logprobs(chunk.logprobs) if self.want_logprobs and chunk.logprobs else None
        if chunk.text or lps:
            out.append(self._make(ChatStreamChoice(index=c.index, delta=ChatDelta(content=chunk.text), logprobs=lps)))
        if chunk.finish_reason:
            out.append(self._make(ChatStreamChoice(index=c.index, delta=ChatDelta(), finish_reason=chunk.finish_reason)))
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        return self._make(None, usage=usage)
