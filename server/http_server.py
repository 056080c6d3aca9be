"""uvicorn as pagedserve runs it: a shutdown that ends its streams itself, and read timeouts.

SIGTERM: uvicorn stops accepting, waits up to `shutdown_timeout` for the requests in
flight, then cancels their tasks, which cuts a stream with no final event. So just before
that, at `shutdown_timeout - margin`, the app ends every request still in flight itself
(ServerState.end_streams): a stream gets an error event and `data: [DONE]`, a non-streamed
request a 503, and uvicorn then finds nothing left to cancel.

    SIGTERM ──► stop accepting ──► ... ──► end_streams() ──► (margin) ──► uvicorn cancels the rest
               t = 0                       t = timeout - margin          t = timeout
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING, Callable

import uvicorn

from server.timeouts import HeaderTimeoutH11Protocol

if TYPE_CHECKING:
    from fastapi import FastAPI

# The time left to the streams to send their last event and close, before uvicorn cancels.
MAX_SHUTDOWN_MARGIN_S = 1.0


class PagedServer(uvicorn.Server):
    """uvicorn.Server that calls `end_streams` just before the shutdown grace runs out."""

    def __init__(self, config: uvicorn.Config, end_streams: Callable[[], None]):
        super().__init__(config)
        self.end_streams = end_streams
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.exit_signal: int | None = None  # the first signal that asked us to stop

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            # A second Ctrl-C: the user wants out now, not uvicorn's cancellation tracebacks.
            sys.stderr.write("pagedserve: second interrupt, exiting without waiting for requests in flight\n")
            sys.stderr.flush()
            os._exit(130)
        if self.exit_signal is None:
            self.exit_signal = sig
        # A signal handler (or another thread, in tests): hand the work to the event loop.
        if not self._draining and self._loop is not None and not self._loop.is_closed():
            self._draining = True
            self._loop.call_soon_threadsafe(self._schedule_end_of_streams)
        super().handle_exit(sig, frame)

    def _schedule_end_of_streams(self) -> None:
        timeout = self.config.timeout_graceful_shutdown
        if timeout is None:
            return  # uvicorn waits for ever: nothing is cut
        margin = min(MAX_SHUTDOWN_MARGIN_S, timeout / 2)
        assert self._loop is not None  # set by serve(), which runs before any exit is handled
        self._loop.call_later(max(0.0, timeout - margin), self.end_streams)


def make_server(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    shutdown_timeout: float = 30.0,
    read_timeout: float = 30.0,
) -> PagedServer:
    """The app's server (create_app's). `read_timeout`: a request's headers must arrive within
    it of the connection opening (or of the previous response), else the connection gets a 408
    and is closed; the body's bound is the app's own (create_app(read_timeout=...)). Idle
    keep-alive connections close after 5 s (uvicorn's default)."""
    protocol = type("PagedH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": read_timeout})
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol,
        timeout_keep_alive=5,
        # uvicorn's stub says int; it waits any number of seconds
        timeout_graceful_shutdown=shutdown_timeout,  # type: ignore[arg-type]
    )
    return PagedServer(config, app.state.server.end_streams)
