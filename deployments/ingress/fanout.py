"""One HTTP request, several engine requests (n choices x a batch of prompts): start them all,
wait for every first chunk before answering (so a refusal is still an HTTP 400/503), then merge
their chunks in arrival order, tagged with the choice index."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from deployments.engine_client import GenerateChunk
from deployments.ingress.sse import close_stream


async def first_chunks(streams: list[AsyncIterator[GenerateChunk]]) -> list[GenerateChunk]:
    """Every stream's first chunk; on any failure every stream is closed (aborting its request)."""
    results = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_all(streams)
        raise errors[0]
    return list(results)


async def close_all(streams: list[AsyncIterator[GenerateChunk]]) -> None:
    for s in streams:
        await close_stream(s)


async def merged(streams: list[AsyncIterator[GenerateChunk]],
                 firsts: list[GenerateChunk]) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """(choice index, chunk) until every stream has finished. A stream that raises ends the merge
    with that error; the caller closes the streams (`close_all`) whatever happens."""
    for i, chunk in enumerate(firsts):
        yield i, chunk
    live = {i for i, chunk in enumerate(firsts) if chunk.finish_reason is None}
    if len(live) == 1:  # the common case: no tasks, no queue
        (i,) = live
        async for chunk in streams[i]:
            yield i, chunk
            if chunk.finish_reason is not None:
                return
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for chunk in streams[i]:
                await queue.put((i, chunk, None))
                if chunk.finish_reason is not None:
                    return
            await queue.put((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i)) for i in sorted(live)]
    try:
        while live:
            i, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None or chunk.finish_reason is not None:
                live.discard(i)
            if chunk is not None:
                yield i, chunk
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
