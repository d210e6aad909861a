"""ASGI middleware: a request id on every request."""
from __future__ import annotations

import re
import uuid

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
