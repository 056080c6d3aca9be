"""Legal but expensive or slow requests: huge prompts are refused without stalling anyone else."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, StreamReader

M = MODEL_NAME
HUGE = "hello world, the quick brown fox " * 210_000  # ~7 MB, under the 8 MiB body limit


def max_health_latency_while(live, work) -> tuple[float, object]:
    """Run work() in a thread and poll /health until it returns: (slowest /health in s, work's result)."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(work()))
    worker.start()
    slowest = 0.0
    with httpx.Client(base_url=live.url, timeout=60) as client:
        while worker.is_alive():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.02)
    worker.join()
    return slowest, result[0]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"model": M, "prompt": HUGE, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": HUGE}]}, "messages"),
        ("/tokenize", {"prompt": HUGE}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
    ],
)
def test_a_7mb_prompt_gets_400_without_freezing_the_server(live, path, body, param):
    def send():
        with httpx.Client(base_url=live.url, timeout=60) as client:
            start = time.monotonic()
            return client.post(path, json=body), time.monotonic() - start

    slowest, (response, took) = max_health_latency_while(live, send)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param
    assert slowest < 1.0, f"/health took {slowest:.2f}s while a 7 MB prompt was refused"
    assert took < 3.0, f"the refusal took {took:.2f}s"


def test_a_prompt_just_under_the_character_bound_is_tokenized_and_judged_by_its_tokens(live):
    limit = live.app.state.server.max_prompt_chars
    response = live.http.post("/v1/completions", json={"model": M, "prompt": "a" * limit, "max_tokens": 1})
    assert response.status_code == 400
    assert "tokens" in response.json()["error"]["message"]
    assert "characters" not in response.json()["error"]["message"]  # tokenized, not refused by length
    assert live.http.post("/tokenize", json={"prompt": "a" * limit}).status_code == 200


def slow_down(engine, seconds_per_output: float) -> None:
    """Make every stream of `engine` last: each output is held back this long."""
    generate = engine.generate

    async def slow_generate(*args, **kwargs):
        async for output in generate(*args, **kwargs):
            await asyncio.sleep(seconds_per_output)
            yield output

    engine.generate = slow_generate


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"model": M, "prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}),
        (
            "/v1/chat/completions",
            {
                "model": M,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 100,
                "ignore_eos": True,
                "stream": True,
            },
        ),
    ],
)
def test_streams_still_running_when_the_shutdown_timeout_ends_get_an_error_event_and_done(start_server, path, body):
    live = start_server(server_kwargs={"shutdown_timeout": 2})
    slow_down(live.engine, 0.2)  # 100 tokens: 20 s, far past the 2 s grace
    reader = StreamReader(f"{live.url}{path}", body)
    assert reader.first.wait(30)
    live.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
    reader.thread.join(30)
    assert not reader.thread.is_alive()
    lines = reader.lines
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"


def _raw_exchange(
    url: str, payload: bytes, trickle: bytes = b"", every: float = 0.0, timeout: float = 10.0
) -> tuple[bytes, float]:
    """Send `payload` on a raw socket (then `trickle` a byte at a time), read to EOF: (reply, seconds)."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(payload)
        for byte in trickle:
            time.sleep(every)
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break  # the server closed the connection
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply, time.monotonic() - start


def _error_of(reply: bytes) -> dict:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"connection: close" in head.lower()
    return json.loads(body)["error"]


REQUEST_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
)


@pytest.mark.parametrize(
    "case", ["headers never finish", "headers trickle", "body shorter than its length", "body trickles"]
)
def test_slow_requests_get_408_and_are_closed_within_the_read_timeout(start_server, case):
    live = start_server(app_kwargs={"read_timeout": 1.0}, server_kwargs={"read_timeout": 1.0})
    body = json.dumps({"model": M, "prompt": "hi", "max_tokens": 1}).encode()
    if case == "headers never finish":
        reply, took = _raw_exchange(live.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    elif case == "headers trickle":
        reply, took = _raw_exchange(live.url, b"POST /v1/", trickle=b"completions HTTP/1.1\r\n" * 4, every=0.2)
    elif case == "body shorter than its length":
        reply, took = _raw_exchange(live.url, REQUEST_HEAD % (len(body) + 100) + body)
    else:
        reply, took = _raw_exchange(live.url, REQUEST_HEAD % len(body), trickle=body, every=0.2)
    error = _error_of(reply)
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert took < 5.0
    response = live.http.post("/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200  # and the server serves on
