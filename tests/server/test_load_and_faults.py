"""Many clients, clients that leave, a full queue, a missing key, a failing request, a model still loading."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.app import create_app
from tests.server.conftest import ENGINE_DEFAULTS, MODEL_NAME, LiveServer

M = MODEL_NAME
PROMPTS = ["Hello world!", "The capital of France is", "Once upon a time, there was", "0 1 2 3 4"]
LONG = dict(max_tokens=100, ignore_eos=True)  # runs long enough to be interrupted


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_64_concurrent_streaming_clients_all_complete(live):
    client = live.client()
    expected = {
        p: client.completions.create(model=M, prompt=p, max_tokens=12, temperature=0).choices[0].text for p in PROMPTS
    }

    async def one(async_client, i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        stream = await async_client.completions.create(
            model=M, prompt=prompt, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return prompt, text, finish, usage

    async def main():
        async with live.async_client() as async_client:
            return await asyncio.gather(*(one(async_client, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, text, finish, usage in results:
        assert text == expected[prompt]
        if finish == "length":
            assert usage.completion_tokens == 12
        assert finish in ("stop", "length")
    live.wait_idle()


def _open_stream(url: str, body: dict) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(base_url=url, timeout=60)
    response = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
    assert response.status_code == 200
    return client, response


def test_clients_that_disconnect_mid_stream_free_their_blocks(live, monkeypatch):
    # Steps of at least 20 ms: on a fast CPU the tiny model's first stream could otherwise run its
    # 100 tokens to the end while the other five open.
    step = live.engine.core.step
    monkeypatch.setattr(live.engine.core, "step", lambda: (time.sleep(0.02), step())[1])
    aborts_before = live.metric("pagedserve:request_success_total", 'finish_reason="abort"')
    opened = []
    for i in range(6):
        client, response = _open_stream(live.url, {"model": M, "prompt": PROMPTS[i % 4], "stream": True, **LONG})
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: {")
        opened.append((client, response))
    assert live.engine.stats().num_kv_blocks_used > 0
    for client, response in opened:  # hang up without reading the rest
        response.close()
        client.close()
    live.wait_idle()
    stats = live.engine.stats()
    assert stats.num_kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert live.metric("pagedserve:request_success_total", 'finish_reason="abort"') == aborts_before + 6
    assert stats.num_finished.get("abort", 0) >= 6


def test_client_that_disconnects_before_a_non_streamed_reply_aborts_it(live):
    aborts_before = live.metric("pagedserve:request_success_total", 'finish_reason="abort"')
    finished_before = dict(live.engine.stats().num_finished)
    body = json.dumps({"model": M, "prompt": "Hello", "n": 2, "max_tokens": 110, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", live.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    wait_until(lambda: live.engine.stats().num_running == 2, what="both choices running")
    sock.close()
    live.wait_idle()
    assert live.metric("pagedserve:request_success_total", 'finish_reason="abort"') == aborts_before + 2
    finished = live.engine.stats().num_finished
    assert finished.get("length", 0) == finished_before.get("length", 0), "the engine ran it to the end anyway"


def test_full_queue_gets_429_with_retry_after(start_server):
    # One running and one waiting request fill it.
    server = start_server(engine_kwargs=dict(max_num_seqs=1, max_num_batched_tokens=64, max_waiting=1))
    # Steps of at least 20 ms: the two held requests (100 tokens each) stay in flight for
    # seconds, however fast the tiny model is, so the refusals below cannot race their end.
    core, step = server.engine.core, server.engine.core.step
    core.step = lambda: (time.sleep(0.02), step())[1]
    held = [_open_stream(server.url, {"model": M, "prompt": p, "stream": True, **LONG}) for p in PROMPTS[:2]]
    wait_until(lambda: server.engine.stats().num_waiting == 1, what="one request waiting")
    refused = server.http.post("/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        server.client().chat.completions.create(
            model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
    assert server.metric("pagedserve:requests_rejected_total", 'reason="queue_full"') == 2
    for client, response in held:
        response.close()
        client.close()
    server.wait_idle()
    ok = server.http.post("/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_api_key_guards_v1_but_not_health_or_metrics(start_server):
    server = start_server(app_kwargs=dict(api_key="s3cret"))
    body = {"model": M, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = server.http.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert server.http.get("/v1/models").status_code == 401
    assert server.http.post("/tokenize", json={"prompt": "hi"}).status_code == 401
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    result = server.client(api_key="s3cret").completions.create(model=M, prompt="hi", max_tokens=2)
    assert result.usage.completion_tokens >= 1


def test_engine_error_in_one_request_ends_only_that_request(start_server):
    server = start_server()
    runner = server.engine.core.runner
    real_execute = runner.execute

    def execute_with_fault(scheduler_output):
        # Fault injection: sampling fails for requests seeded 666, as a real per-request failure would.
        result = real_execute(scheduler_output)
        for s in scheduler_output.scheduled:
            if s.samples and s.params.seed == 666:
                result.sampled.pop(s.request_id, None)
                result.errors[s.request_id] = "injected sampling failure"
        return result

    runner.execute = execute_with_fault
    client = server.client()
    healthy = threading.Thread(target=lambda: client.completions.create(model=M, prompt="Hello", max_tokens=40))
    healthy.start()
    response = server.http.post("/v1/completions", json={"model": M, "prompt": "Hello", "max_tokens": 5, "seed": 666})
    assert response.status_code == 500
    error = response.json()["error"]
    assert "injected sampling failure" in error["message"] and error["type"] == "server_error"
    with pytest.raises(openai.APIError, match="injected sampling failure"):
        for _ in client.chat.completions.create(
            model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=5, seed=666, stream=True
        ):
            pass
    healthy.join(60)
    ok = client.completions.create(model=M, prompt="Hello", max_tokens=3, seed=1)
    assert ok.choices[0].finish_reason == "length"
    assert server.metric("pagedserve:request_success_total", 'finish_reason="error"') == 2
    server.wait_idle()


class _EngineThreadKilled(BaseException):
    """Not an Exception: no handler inside the engine thread's loop contains it, so the thread dies."""


def test_engine_thread_death_ends_open_streams_with_an_error_and_turns_health_503(start_server):
    server = start_server()
    assert server.http.get("/health").status_code == 200
    core = server.engine.core
    real_step, first_token = core.step, threading.Event()

    def step_then_die():  # one step with a token, then the engine thread dies in the next
        if first_token.is_set():
            raise _EngineThreadKilled("injected")
        outputs = real_step()
        if any(out.token_ids for out in outputs):
            first_token.set()
        return outputs

    core.step = step_then_die
    client = httpx.Client(base_url=server.url, timeout=20)  # a stream left open fails the test here
    body = {"model": M, "prompt": PROMPTS[0], "stream": True, **LONG}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    client.close()
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["code"] == "engine_error" and "_EngineThreadKilled" in error["message"]
    assert all(json.loads(d).get("choices", [{}])[0].get("finish_reason") is None for d in data[:-2])
    health = server.http.get("/health")
    assert health.status_code == 503 and "stopped" in health.json()["error"]["message"]
    assert server.http.post("/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 2}).status_code >= 500


def test_health_is_503_until_the_model_has_loaded(tiny_loaded):
    release = threading.Event()

    def slow_factory():
        release.wait(60)
        return AsyncEngine(tiny_loaded, EngineConfig(**ENGINE_DEFAULTS))

    server = LiveServer(create_app(engine_factory=slow_factory, served_model_name=M)).start()
    try:
        loading = server.http.get("/health")
        assert loading.status_code == 503 and "loading" in loading.json()["error"]["message"]
        refused = server.http.post("/v1/completions", json={"model": M, "prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_loading"
        assert server.http.get("/metrics").status_code == 200
        release.set()
        wait_until(lambda: server.http.get("/health").status_code == 200, what="health 200")
        result = server.client().completions.create(model=M, prompt="hi", max_tokens=2)
        assert result.usage.completion_tokens >= 1
    finally:
        release.set()
        server.stop()
