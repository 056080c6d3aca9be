"""A kept-alive connection the server closes as the next request goes out (llama.cpp's
llama-server does this to some sequential requests): the request is sent again on a new
connection, counted, instead of failing. A raw asyncio HTTP/1.1 server on 127.0.0.1 makes the
race deterministic: it answers the first request of each connection and closes the connection,
without a byte, on the second."""

from __future__ import annotations

import asyncio
import json

import httpx

from loadtest import client as loadtest_client
from loadtest.client import Outcome, send_request
from loadtest.metrics import summarize
from loadtest.workload import RequestSpec


def _sse_body() -> bytes:
    chunks = [
        {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
        for i in range(3)
    ]
    chunks.append(
        {
            "id": "c",
            "object": "text_completion",
            "choices": [],
            "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
        }
    )
    return ("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n").encode()


async def _read_request(reader: asyncio.StreamReader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
    )
    await reader.readexactly(length)
    return True


async def _serve(answered_per_connection: int | None):
    """Answers `answered_per_connection` requests on each connection (None: all), then closes it
    at the next one without a response; 0 closes every connection unanswered."""
    connections = []

    async def handle(reader, writer):
        connections.append(writer)
        served = 0
        try:
            while await _read_request(reader):
                if answered_per_connection is not None and served >= answered_per_connection:
                    break
                body = _sse_body()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions", connections


async def _run(answered_per_connection: int | None, requests: int) -> tuple[list, int]:
    server, url, connections = await _serve(answered_per_connection)
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as http:
            records = []
            for i in range(requests):  # one stream, requests back to back: each reuses the last connection
                spec = RequestSpec(i, "a b", 2, 3, None)
                records.append(await send_request(http, url, {"prompt": "a b", "stream": True}, spec, "completions"))
        return records, len(connections)
    finally:
        for writer in connections:  # handlers still waiting for a request see the end of the stream
            writer.close()
        server.close()
        await server.wait_closed()


def test_a_reused_connection_closed_unanswered_is_resent_on_a_new_one():
    records, connections = asyncio.run(_run(answered_per_connection=1, requests=4))
    assert [r.outcome for r in records] == [Outcome.COMPLETED] * 4
    assert [r.stale_retries for r in records] == [0, 1, 1, 1]
    assert connections == 4 and all(r.output_tokens == 3 for r in records)
    summary = summarize(records, duration_s=1.0)
    assert summary["stale_connection_retries"] == 3 and summary["failed"] == 0


def test_without_the_resend_those_requests_fail_and_a_server_that_never_answers_still_fails(monkeypatch):
    monkeypatch.setattr(loadtest_client, "STALE_CONNECTION_RETRIES", 0)
    records, _ = asyncio.run(_run(answered_per_connection=1, requests=4))
    # The failed send's connection is dropped, so the request after it gets a fresh one.
    assert [r.error_kind for r in records] == [None, "connection_closed", None, "connection_closed"]
    monkeypatch.undo()
    records, connections = asyncio.run(_run(answered_per_connection=0, requests=2))
    assert [r.error_kind for r in records] == ["connection_closed"] * 2
    assert [r.stale_retries for r in records] == [loadtest_client.STALE_CONNECTION_RETRIES] * 2
    assert connections == 2 * (loadtest_client.STALE_CONNECTION_RETRIES + 1)


def test_a_server_that_keeps_connections_alive_is_never_resent():
    records, connections = asyncio.run(_run(answered_per_connection=None, requests=5))
    assert [r.stale_retries for r in records] == [0] * 5 and connections == 1
    assert all(r.outcome is Outcome.COMPLETED for r in records)
