"""Engine chunks -> OpenAI bodies: the whole answer, and stream chunks in OpenAI's order (the
ingress streams or collects; these only format)."""
from __future__ import annotations

import time
from typing import Callable

from deployments.engine_client import GenerateChunk
from deployments.protocol.responses import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionResponse,
                                            ChatDelta, ChatStreamChoice, CompletionChoice, CompletionResponse, Usage)


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
