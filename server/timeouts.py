"""Read timeouts: a client may not hold a connection open by sending its request slowly.

    connection opens ──► headers complete ──► body complete ──► response ──► next request's headers
    └── header_timeout ──┘ └──────── read_timeout (app) ─────┘              └── header_timeout ──┘

uvicorn bounds neither: slow headers, a slow body, or a Content-Length larger than the body
sent would hold a connection (and, for the body, a request task) for ever. Headers are
bounded in the HTTP protocol (HeaderTimeoutH11Protocol: a 408 written on the socket, then
close); the body in the app (BodyTimeoutMiddleware: a 408 in the OpenAI error shape, then close).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import APIError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_READ_TIMEOUT_S = 30.0


def _timeout_error(what: str, timeout: float) -> APIError:
    return APIError(
        408,
        f"The request's {what} did not arrive within {timeout:g} seconds.",
        code="request_timeout",
        headers={"Connection": "close"},
    )


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a bound on the time a request's headers take to arrive."""

    header_timeout: float = DEFAULT_READ_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._arm_header_timer()  # first: a pipelined request's headers, parsed below, disarm it
        super().on_response_complete()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete
            self._disarm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        body = json.dumps(_timeout_error("headers", self.header_timeout).body()).encode()
        head = (
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        )
        self.transport.write(head + body)
        self.transport.close()


class BodyTimeoutMiddleware:
    """408 when a request's whole body has not arrived within `timeout` seconds of its headers.

    Plain ASGI: the bound is on the app's receive(), so it holds however a route reads the
    body; once the body is complete, receive() (which then waits for a disconnect) is not bounded.
    """

    def __init__(self, app: ASGIApp, timeout: float):
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        body_complete = False

        async def timed_receive() -> Message:
            nonlocal body_complete
            if body_complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise _timeout_error("body", self.timeout) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_complete = True
            return message

        await self.app(scope, timed_receive, send)
