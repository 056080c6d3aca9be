"""Server-sent events as OpenAI sends them, and aborting work when the client goes away.

    data: {"id": "cmpl-...", ...}\\n\\n     one event per chunk
    data: {"error": {...}}\\n\\n           if the request fails mid-stream
    data: [DONE]\\n\\n                     always last

Streaming: Starlette's StreamingResponse watches the connection and cancels
the body iterator when the client disconnects; the iterator's `finally`
(in serving_common.stream_choices) then aborts the engine requests.
Non-streaming: `run_unless_disconnected` races the work against the
disconnect and cancels the work if the client leaves first.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_response(events: AsyncIterator[str], headers: dict[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has gone away (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Shielded: the cancelled work must finish its cleanup (engine aborts) even if
            # this handler is itself being cancelled.
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)


def disconnected_response() -> Response:
    # Nobody reads it; 499 is the conventional "client closed request" status for logs.
    return Response(status_code=499)
