"""End to end: `python -m server` with no --model (the default SmolLM2-135M-Instruct, dtype auto),
driven by the official openai client over a real socket."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.server.conftest import wait_healthy

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def server():
    from models.fetch import default_model_path

    default_model_path()  # fetch (once) before the clock starts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--port", str(port), "--max-model-len", "2048", "--kv-cache-memory", "0.25",
         "--log-level", "warning"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=600)
        yield url
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert code == 0, proc.stdout.read()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def test_default_model_is_served_under_its_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_answers_and_stream_matches(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    answer = whole.choices[0].message.content
    assert "Paris" in answer
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason]


def test_completion_stream_matches_and_stop_and_logprobs(client):
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=2)
    text = whole.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == text and len(lp.tokens) == whole.usage.completion_tokens
    assert all(max(top.values()) == pytest.approx(l, abs=1e-4) for top, l in zip(lp.top_logprobs, lp.token_logprobs))
    assert "Paris" in text
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=["Paris"])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index("Paris")]


def test_sampling_with_seed_and_n(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
                  max_tokens=20, temperature=0.9, top_p=0.95, seed=42)
    # In bfloat16 the logits depend slightly on how a step is batched (a prefix-cache hit or a
    # full prefill, alone or beside other requests), and a sampled token can flip on that. So
    # compare runs made under the same conditions: warm the cache, then one request at a time.
    # (The float32 tests in tests/server pin exact reproducibility, n > 1 included.)
    client.chat.completions.create(**kwargs)
    first, again = (client.chat.completions.create(**kwargs).choices[0].message.content for _ in range(2))
    assert first == again
    both = client.chat.completions.create(n=2, **kwargs)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].message.content != both.choices[1].message.content


def test_chat_logprobs_and_cached_prompt(client):
    messages = [{"role": "system", "content": "You are a terse assistant. " * 8}, *QUESTION]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = first.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == first.choices[0].message.content
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 16 > 0
