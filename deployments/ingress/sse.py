"""Server-sent events, and cancelling work when the client goes away."""
from __future__ import annotations

import json
from typing import AsyncIterator, Awaitable

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse


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


SSE_DONE = "data: [DONE]\n\n"


async def close_stream(stream: AsyncIterator) -> None:
    with anyio.CancelScope(shield=True):  # cleanup must run even while being cancelled
        await stream.aclose()


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
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
