"""The OpenAI handlers behind the routes: check the model and the context length, tokenize, stream
from an EngineClient (or collect the whole answer) and map engine errors to OpenAI error bodies.

Shapes are checked by the pydantic request models; what a parameter *means* (ranges, sampling
semantics) is checked once, by the engine's SamplingParams, whose InvalidRequestError -> 400.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deployments import protocol as p
from deployments.engine_client import EngineClient, GenerateChunk, GenerateRequest, ModelInfo
from deployments.ingress.errors import HTTPError, error_payload
from deployments.ingress.settings import IngressSettings
from deployments.ingress.sse import SSE_DONE, SSEResponse, close_stream, sse_event, unless_disconnected
from deployments.metrics import RequestTimer, ServeMetrics
from engine.sampling_params import SamplingParams

Render = Callable[[GenerateChunk], list[dict]]


class IngressServer:
    """State and handlers behind the routes (one per app)."""

    def __init__(self, engine: EngineClient, settings: IngressSettings, metrics: ServeMetrics | None):
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        if self._info is None:  # static facts: fetch once
            self._info = await self.engine.model_info()
            if self.metrics is None:
                self.metrics = ServeMetrics(self._info.served_model_name, max_model_len=self._info.max_model_len)
        return self._info

    def error_payload(self, exc: BaseException, rid: str) -> tuple[int, dict, dict[str, str]]:
        return error_payload(exc, rid, self.settings.retry_after_s)

    async def guarded(self, request: Request, work: Callable[[], Awaitable[Any]]) -> Response:
        try:
            result = await work()
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            status, body, headers = self.error_payload(exc, request.state.request_id)
            return JSONResponse(body, status_code=status, headers=headers)
        return result if isinstance(result, Response) else JSONResponse(result)

    async def checked_model(self, name: str) -> ModelInfo:
        info = await self.model_info()
        if name != info.served_model_name:
            raise HTTPError(400, f"model {name!r} is not served here; use {info.served_model_name!r}",
                            param="model", code="model_not_found")
        return info

    @staticmethod
    def max_tokens(info: ModelInfo, num_prompt: int, requested: int | None, default: int | None, prompt_param: str) -> int:
        left = info.max_model_len - num_prompt
        if num_prompt == 0:
            raise HTTPError(400, "the prompt has no tokens", param=prompt_param)
        if left < 1:
            raise HTTPError(400, f"the prompt has {num_prompt} tokens but the context length is "
                            f"{info.max_model_len}; shorten the prompt", param=prompt_param)
        if requested is None:
            return left if default is None else min(default, left)
        if requested > left:
            raise HTTPError(400, f"max_tokens ({requested}) + prompt tokens ({num_prompt}) exceed the context "
                            f"length ({info.max_model_len}); ask for at most {left}", param="max_tokens")
        return requested

    async def respond(self, request: Request, gen: GenerateRequest, streaming: bool, render: Render,
                      build: Callable[[str, GenerateChunk], dict], timer: RequestTimer) -> Response:
        # Wait for the first chunk before answering, so that a refusal (400/503) is an HTTP status
        # and not an error event inside a 200 stream.
        stream = self.engine.generate(gen)
        try:
            first = await anext(stream)
        except BaseException:
            await close_stream(stream)
            raise
        if streaming:
            return SSEResponse(self.events(gen.request_id, first, stream, timer, render),
                               headers={"Cache-Control": "no-cache"})
        return await unless_disconnected(request, self.collect(first, stream, timer, build))

    async def collect(self, first: GenerateChunk, stream: AsyncIterator[GenerateChunk], timer: RequestTimer,
                      build: Callable[[str, GenerateChunk], dict]) -> Response:
        parts, last, finish = [], first, "abort"
        chunk: GenerateChunk | None = first
        try:
            while chunk is not None:
                timer.on_tokens(len(chunk.token_ids))
                parts.append(chunk.text)
                last = chunk
                chunk = None if chunk.finish_reason else await anext(stream, None)
            finish = last.finish_reason or "abort"
        except Exception:
            finish = "error"
            raise
        finally:
            self.observe(timer, finish, last)
            await close_stream(stream)
        body = build("".join(parts), last)
        if last.queue_time_s is not None and isinstance(body.get("usage"), dict):
            body["usage"]["queue_time_s"] = last.queue_time_s
        return JSONResponse(body)

    async def events(self, rid: str, first: GenerateChunk, stream: AsyncIterator[GenerateChunk],
                     timer: RequestTimer, render: Render) -> AsyncIterator[str]:
        last, finish = first, "abort"  # stays "abort" when the client goes away mid-stream
        chunk: GenerateChunk | None = first
        try:
            while chunk is not None:
                timer.on_tokens(len(chunk.token_ids))
                last = chunk
                events = render(chunk)
                if chunk.queue_time_s is not None and events:  # for load generators (ops/bench/loadgen.py)
                    events[-1] = {**events[-1], "queue_time_s": chunk.queue_time_s}
                for data in events:
                    yield sse_event(data)
                if chunk.finish_reason:
                    finish = chunk.finish_reason
                    break
                chunk = await anext(stream, None)
        except Exception as exc:  # noqa: BLE001 - the 200 is already sent; report it in the stream
            finish = "error"
            yield sse_event(self.error_payload(exc, rid)[1])
        finally:
            self.observe(timer, finish, last)
            await close_stream(stream)
        yield SSE_DONE

    def observe(self, timer: RequestTimer, finish: str, last: GenerateChunk) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(timer.record(finish, last.num_prompt_tokens, last.num_output_tokens))

    # ---- handlers ----

    async def completions(self, request: Request, body: p.CompletionRequest) -> Response:
        timer, rid = RequestTimer(), _request_id(request, "cmpl")
        body.check_supported()
        info = await self.checked_model(body.model)
        check_sampling(body, body.max_tokens, info)
        if isinstance(body.prompt, str):
            ids = await self.engine.tokenize(body.prompt)
        else:
            ids = body.prompt
            if any(not 0 <= t < info.vocab_size for t in ids):
                raise HTTPError(400, f"prompt token ids must be in [0, {info.vocab_size})", param="prompt")
        max_tokens = self.max_tokens(info, len(ids), body.max_tokens, self.settings.completion_max_tokens, "prompt")
        gen = GenerateRequest(rid, tuple(ids), max_tokens, **body.sampling_fields())
        render = p.completion_stream_renderer(rid, info.served_model_name, body.include_usage)
        build = lambda text, last: p.completion_body(rid, info.served_model_name, text, last)  # noqa: E731
        return await self.respond(request, gen, body.stream, render, build, timer)

    async def chat(self, request: Request, body: p.ChatCompletionRequest) -> Response:
        timer, rid = RequestTimer(), _request_id(request, "chatcmpl")
        body.check_supported()
        info = await self.checked_model(body.model)
        check_sampling(body, body.requested_max_tokens(), info)
        ids = await self.engine.tokenize_chat(body.chat_messages())
        max_tokens = self.max_tokens(info, len(ids), body.requested_max_tokens(), None, "messages")
        gen = GenerateRequest(rid, tuple(ids), max_tokens, **body.sampling_fields())
        render = p.chat_stream_renderer(rid, info.served_model_name, body.include_usage)
        build = lambda text, last: p.chat_body(rid, info.served_model_name, text, last)  # noqa: E731
        return await self.respond(request, gen, body.stream, render, build, timer)

    async def models(self) -> dict:
        info = await self.model_info()
        card = p.ModelCard(id=info.served_model_name, created=info.created, max_model_len=info.max_model_len)
        return p.ModelList(data=[card]).model_dump()

    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.engine.check_health(), self.settings.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure means "do not route traffic here"
            reason = str(exc) or f"no answer within {self.settings.health_timeout_s} s"
            return JSONResponse(p.error_body(503, f"engine unhealthy: {reason}"), status_code=503)
        return JSONResponse({"status": "ok"})


def check_sampling(body: p.ChatCompletionRequest | p.CompletionRequest, max_tokens: int | None,
                   info: ModelInfo) -> None:
    """Fail fast, before any tokenizing or queueing, with the engine's own validator and limits (the
    engine checks the same again; nothing here decides what a value means)."""
    params = SamplingParams.create(max_tokens=max_tokens, **body.sampling_fields())
    if info.stop_limits is not None:
        params.check_stop_limits(*info.stop_limits)


def _request_id(request: Request, prefix: str) -> str:
    request.state.request_id = f"{prefix}-{request.state.request_base}"
    return request.state.request_id
