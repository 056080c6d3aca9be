"""Legal but expensive or slow requests: huge prompts are refused without stalling anyone else."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

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


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": M, "prompt": HUGE, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": HUGE}]}, "messages"),
    ("/tokenize", {"prompt": HUGE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
])
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
