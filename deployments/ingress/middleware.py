"""ASGI middleware: a request id on every request; a bound on the request body."""
from __future__ import annotations

import re
import uuid

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from deployments.protocol import error_body

_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


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


class BodyLimitMiddleware:
    """Refuse a request body over `max_bytes` with 413: at once when Content-Length says so, else as
    soon as the bytes read pass the limit (chunked uploads), so a huge body is never held in memory.
    FastAPI re-raises the HTTPException raised while it reads the body; the app's handler turns it
    into an OpenAI error body."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> HTTPException:
        return HTTPException(413, f"the request body is larger than {self.max_bytes} bytes (max_body_bytes); "
                                  "send a shorter prompt")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            response = JSONResponse(error_body(413, self._too_large().detail), 413)
            return await response(scope, receive, send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, counted_receive, send)
