"""The OpenAI-compatible HTTP front: validates requests, applies the chat template (through the
engine's tokenizer), streams from an EngineClient and maps engine errors to OpenAI error bodies.

Pure FastAPI, no Ray: tests run it with a FakeEngine. In Ray Serve the ingress deployment builds it
at replica start with a HandleEngineClient (`@serve.ingress()` + `__serve_build_asgi_app__`).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import protocol as p
from deployments.engine_client import AdminUpdate, EngineClient, GenerateChunk, GenerateRequest, ModelInfo
from deployments.metrics import RequestTimer, ServeMetrics
from engine.errors import EngineOverloadedError, InvalidRequestError

logger = logging.getLogger("morphserve.ingress")
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
Render = Callable[[GenerateChunk], list[dict]]


class IngressSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    api_key: str | None = Field(None, description="when set, /v1/* needs 'Authorization: Bearer <api_key>'")
    admin_token: str | None = Field(None, description="when set, /admin/* needs 'Authorization: Bearer <admin_token>'; unset: admin is off (403)")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with 503 when the engine is full")
    completion_max_tokens: int = Field(16, ge=1, description="/v1/completions default max_tokens (OpenAI's); chat defaults to the context left")
    health_timeout_s: float = Field(5.0, gt=0, description="/health fails when the engine does not answer within this")
    echo_request_id: bool = Field(True, description="add x-request-id to responses; False behind Ray Serve, whose proxy adds it")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class RequestIdMiddleware:
    """Every request gets an id: the client's (or Ray Serve's proxy's) `x-request-id` when it is a
    sane token, else a new one. Routes name the engine request `cmpl-<id>` / `chatcmpl-<id>` (the
    body's `id`); the response's `x-request-id` header carries <id>. Behind Ray Serve the proxy
    already returns that header, so `echo_header` is off there."""

    def __init__(self, app, echo_header: bool = True):
        self.app, self.echo_header = app, echo_header

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", ())).get(b"x-request-id", b"").decode("latin-1")
        base = given if _SANE_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_base"] = state["request_id"] = base

        async def send_with_id(message):
            if message["type"] == "http.response.start" and self.echo_header:
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", base.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class SSEResponse(StreamingResponse):
    """Server-sent events that notice a client disconnect whatever the ASGI spec version (Starlette
    only listens for it below 2.4) and always close the body iterator, which closes the engine stream
    and so aborts the request at once instead of when the garbage collector gets to it."""
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream_then_stop() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def sse_event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _close(stream: AsyncIterator[GenerateChunk]) -> None:
    with anyio.CancelScope(shield=True):  # cleanup must run even while being cancelled
        await stream.aclose()


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    return value[7:].strip() if value[:7].lower() == "bearer " else None


def _token_matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 details -> 400 with one OpenAI-style message naming the parameter."""
    parts, param = [], None
    for err in exc.errors()[:3]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        param = param or (where or None)
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return JSONResponse(p.error_body(400, "; ".join(parts) or "invalid request body", param), status_code=400)


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`, cancelling it when the client goes away (non-streaming requests)."""
    result: list[Response] = []
    async with anyio.create_task_group() as group:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        result.append(await work)
        group.cancel_scope.cancel()
    return result[0] if result else Response(status_code=499)  # nobody is listening any more


class _Server:
    """State and handlers behind the routes (one per app)."""

    def __init__(self, engine: EngineClient, settings: IngressSettings, metrics: ServeMetrics | None):
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        if self._info is None:  # static facts: fetch once
            self._info = await self.engine.model_info()
            if self.metrics is None:
                self.metrics = ServeMetrics(self._info.served_model_name)
        return self._info

    def error_payload(self, exc: BaseException, rid: str) -> tuple[int, dict, dict[str, str]]:
        if isinstance(exc, HTTPError):
            return exc.status, p.error_body(exc.status, str(exc), exc.param, exc.code), {}
        if isinstance(exc, (InvalidRequestError, p.UnsupportedFeature)):
            return 400, p.error_body(400, str(exc), exc.param), {}
        if isinstance(exc, EngineOverloadedError):
            return 503, p.error_body(503, str(exc)), {"Retry-After": str(self.settings.retry_after_s)}
        # A fault, not the client's: log it with the request id, answer 500, keep serving.
        logger.error("request %s failed", rid, exc_info=(type(exc), exc, exc.__traceback__))
        return 500, p.error_body(500, f"internal error while serving {rid}; the server log has details"), {}

    async def guarded(self, request: Request, work: Callable[[], Awaitable[Any]]) -> Response:
        try:
            result = await work()
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
            status, body, headers = self.error_payload(exc, request.state.request_id)
            return JSONResponse(body, status_code=status, headers=headers)
        return result if isinstance(result, Response) else JSONResponse(result)

    async def require_api_key(self, request: Request) -> None:
        if self.settings.api_key is not None and not _token_matches(_bearer(request), self.settings.api_key):
            raise HTTPError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")

    async def require_admin(self, request: Request) -> None:
        if self.settings.admin_token is None:
            raise HTTPError(403, "the admin API is off; configure an admin_token to turn it on")
        if not _token_matches(_bearer(request), self.settings.admin_token):
            raise HTTPError(401, "missing or incorrect admin token; send 'Authorization: Bearer <admin_token>'",
                            code="invalid_admin_token")

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
            await _close(stream)
            raise
        if streaming:
            return SSEResponse(self.events(gen.request_id, first, stream, timer, render),
                               headers={"Cache-Control": "no-cache"})
        return await _unless_disconnected(request, self.collect(first, stream, timer, build))

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
            await _close(stream)
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
            await _close(stream)
        yield "data: [DONE]\n\n"

    def observe(self, timer: RequestTimer, finish: str, last: GenerateChunk) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(timer.record(finish, last.num_prompt_tokens, last.num_output_tokens))

    # ---- handlers ----

    async def completions(self, request: Request, body: p.CompletionRequest) -> Response:
        timer, rid = RequestTimer(), _request_id(request, "cmpl")
        body.check_supported()
        info = await self.checked_model(body.model)
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

    async def admin_set(self, body: p.MorphAdminRequest) -> dict:
        if body.precision is not None and body.quantized_layers is None:
            raise HTTPError(400, "precision applies to quantized_layers; send both", param="precision")
        if body.mode is None and body.morphing_enabled is None and body.quantized_layers is None:
            raise HTTPError(400, "send at least one of mode, morphing_enabled, quantized_layers")
        return await self.engine.admin_set(AdminUpdate(**body.model_dump()))

    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.engine.check_health(), self.settings.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure means "do not route traffic here"
            reason = str(exc) or f"no answer within {self.settings.health_timeout_s} s"
            return JSONResponse(p.error_body(503, f"engine unhealthy: {reason}"), status_code=503)
        return JSONResponse({"status": "ok"})


def _request_id(request: Request, prefix: str) -> str:
    request.state.request_id = f"{prefix}-{request.state.request_base}"
    return request.state.request_id


def build_ingress_app(engine: EngineClient, settings: IngressSettings | None = None,
                      metrics: ServeMetrics | None = None) -> FastAPI:
    """The FastAPI app over `engine`. `metrics` defaults to ServeMetrics for the served model (Ray
    metrics inside a Serve replica, in memory elsewhere)."""
    server = _Server(engine, settings or IngressSettings(), metrics)
    app = FastAPI(title="MorphServe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(RequestIdMiddleware, echo_header=server.settings.echo_request_id)

    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    async def http_error(request: Request, exc: HTTPError) -> JSONResponse:
        status, body, headers = server.error_payload(exc, request.state.request_id)
        return JSONResponse(body, status_code=status, headers=headers)

    async def starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # 404, 405
        return JSONResponse(p.error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPError, http_error)
    app.add_exception_handler(StarletteHTTPException, starlette_error)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.require_api_key)])

    @v1.get("/models")
    async def models(request: Request) -> Response:
        return await server.guarded(request, server.models)

    @v1.post("/completions")
    async def completions(request: Request, body: p.CompletionRequest) -> Response:
        return await server.guarded(request, lambda: server.completions(request, body))

    @v1.post("/chat/completions")
    async def chat(request: Request, body: p.ChatCompletionRequest) -> Response:
        return await server.guarded(request, lambda: server.chat(request, body))

    admin = APIRouter(prefix="/admin", dependencies=[Depends(server.require_admin)])

    @admin.get("/morph")
    async def morph_status(request: Request) -> Response:
        return await server.guarded(request, server.engine.admin_status)

    @admin.post("/morph")
    async def morph_set(request: Request, body: p.MorphAdminRequest) -> Response:
        return await server.guarded(request, lambda: server.admin_set(body))

    app.include_router(v1)
    app.include_router(admin)
    app.add_api_route("/health", server.health, methods=["GET"])
    return app
