"""The tail every endpoint shares: hand the choices to the engine, then stream
them as SSE or wait for them (aborting if the client leaves) and answer in JSON."""

from __future__ import annotations

import logging
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Protocol

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.request import RequestOutput
from server.errors import APIError, error_body
from server.serving_common import Choice, ServerState, log_request, stream_choices, timing_headers
from server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    disconnected_response,
    run_unless_disconnected,
    sse_event,
    sse_response,
)

logger = logging.getLogger(__name__)

_SUCCESS = ("stop", "length")


class View(Protocol):
    """How one endpoint renders its choices (chat.completion or text_completion). A view may
    also frame its stream's ending itself (Anthropic's has no [DONE] and its own error event):
    `error_event(exc) -> str` and `end_event: str`; OpenAI's framing otherwise."""

    def response(self, choices: list[Choice]) -> dict[str, Any]: ...

    def chunks(self, events: AsyncIterator) -> AsyncIterator[str]: ...


def openai_error_event(exc: Exception) -> str:
    if isinstance(exc, APIError):
        return sse_event(exc.body())
    return sse_event(error_body(500, str(exc), code="engine_error"))


async def respond(
    request: Request,
    state: ServerState,
    choices: list[Choice],
    view: View,
    arrival: float,
    request_id: str,
    user: str | None,
    stream: bool,
) -> Response:
    log_request(request_id, choices, user, stream)
    events = stream_choices(state, choices, arrival)
    await anext(events)  # admitted and accepted by the engine, or an APIError (429, 400)
    if stream:
        body = _guarded(
            view.chunks(events),
            events,
            request_id,
            getattr(view, "error_event", openai_error_event),
            getattr(view, "end_event", SSE_DONE),
        )
        return sse_response(body, headers={"X-Request-Id": request_id})
    try:
        await run_unless_disconnected(request, _drain(events))
    except ClientDisconnected:
        return disconnected_response()
    failed = next((c.final_output for c in choices if c.final_output.finish_reason not in _SUCCESS), None)
    if failed is not None:
        raise APIError(
            500, f"The request failed in the engine: {failed.error or failed.finish_reason}", code="engine_error"
        )
    result = view.response(choices)
    headers = {"X-Request-Id": request_id, **timing_headers(result["usage"]["timings"])}
    return JSONResponse(result, headers=headers)


def check_succeeded(choice: Choice, output: RequestOutput) -> None:
    """A choice that ended in error or abort ends the stream with an in-band error event."""
    if output.finished and output.finish_reason not in _SUCCESS:
        raise RuntimeError(f"request {choice.request_id} failed: {output.error or output.finish_reason}")


async def _drain(events: AsyncIterator) -> None:
    async for _ in events:
        pass


async def _guarded(
    chunks: AsyncIterator[str],
    events: AsyncGenerator[Any, None],
    request_id: str,
    error_event: Callable[[Exception], str],
    end_event: str,
) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - the stream has started: report it in-band
        logger.warning("stream %s failed: %s", request_id, exc)
        yield error_event(exc)
    finally:
        # Closing the engine stream aborts whatever is still running (client gone).
        with anyio.CancelScope(shield=True):
            await events.aclose()
    if end_event:
        yield end_event
