"""Two `python -m server` replicas behind vllm-router (cache_aware) on 127.0.0.1.

What the router does to a request (0.1.17, seen on a worker that logs bodies): it adds
`no_stop_trim`, `ignore_eos`, `skip_special_tokens`, `return_hidden_states` (and on chat
`continue_final_message`, `separate_reasoning`, `stream_reasoning`, `include_reasoning`, `logprobs`)
at their defaults, keeps `max_tokens` as sent, and for cache_aware first asks a worker for the
prompt's tokens: POST /v1/{chat/,}completions/render (vLLM's; 404 here), then POST /tokenize
(chat with `continue_final_message`, skipped when the request has tools).

A dead replica: a refused connection is a 500 the router retries, re-selecting a worker each
attempt; the circuit breaker (--cb-failure-threshold 1) takes the dead one out after its first
failure and the health checker marks it unhealthy, so every later request lands on the live one.
A stream the dead replica was serving is cut (no `data: [DONE]`); nothing replays it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.models.conftest import make_hf_model, save_checkpoint
from tests.server.conftest import StreamReader, wait_healthy

REPO = Path(__file__).resolve().parents[2]
ROUTER = Path(sys.executable).with_name("vllm-router")
M = "tiny"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_NUM_SEQS = 4  # small, so the metrics test sees requests waiting
PROMPT = "The quick brown fox jumps over the lazy dog."
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
# Retry at once, drop a worker on its first failed request, notice a dead one within ~2 s.
ROUTER_FLAGS = [
    "--policy",
    "cache_aware",
    "--cb-failure-threshold",
    "1",
    "--cb-timeout-duration-secs",
    "10",
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "2",
    "--retry-initial-backoff-ms",
    "10",
    "--retry-max-backoff-ms",
    "200",
    "--worker-startup-check-interval",
    "1",
    "--log-level",
    "warning",
]

pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (test extras)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child process with its output in a file, stopped through its own handle."""

    def __init__(self, args: list[str], log: Path, url: str):
        self.url, self.log = url, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 120) -> None:
        wait_healthy(self.proc, self.url, timeout, output=lambda: self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(15)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)


class Cluster:
    def __init__(self, replicas: list[Process], router: Process):
        self.replicas, self.router = replicas, router


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Room for a tools prompt (the Hermes tool preamble is ~400 tokens of this tokenizer).
    tmp = tmp_path_factory.mktemp("router")
    model = save_checkpoint(make_hf_model("llama", seed=3, max_position_embeddings=2048), tmp / "model")
    started: list[Process] = []
    try:
        for i in range(2):
            port = free_port()
            started.append(
                Process(
                    [
                        sys.executable,
                        "-m",
                        "server",
                        "--model",
                        str(model),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--served-model-name",
                        M,
                        "--dtype",
                        "float32",
                        "--num-threads",
                        "1",
                        "--num-kv-blocks",
                        "512",
                        "--block-size",
                        "8",
                        "--max-num-seqs",
                        str(MAX_NUM_SEQS),
                        "--shutdown-timeout",
                        "2",
                        "--log-level",
                        "warning",
                    ],
                    tmp / f"replica{i}.log",
                    f"http://127.0.0.1:{port}",
                )
            )
        for replica in started:
            replica.wait_healthy()
        # The router starts once any one worker answers /health: both are up before it starts.
        port = free_port()
        router = Process(
            [
                str(ROUTER),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--worker-urls",
                *(r.url for r in started[:2]),
                *ROUTER_FLAGS,
            ],
            tmp / "router.log",
            f"http://127.0.0.1:{port}",
        )
        started.append(router)
        router.wait_healthy(60)
        yield Cluster(started[:2], router)
    finally:
        for process in reversed(started):
            process.stop()


def metrics(url: str) -> dict[str, float]:
    """The vllm:* samples of /metrics, parsed by prometheus_client, by name."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:") and s.labels.get("model_name") == M
    }


def router_workers(url: str) -> dict[str, bool]:
    """The router's view: worker URL -> healthy."""
    return {w["url"]: w["is_healthy"] for w in httpx.get(f"{url}/workers", timeout=10).json()["workers"]}


def streamed_text(stream, chat: bool) -> str:
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return "".join(c.choices[0].text for c in stream if c.choices)


def tool_calls(reply) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in reply.choices[0].message.tool_calls or ()]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_answers_through_the_router_equal_direct_ones(cluster, stream):
    routed, direct = cluster.router.client(), cluster.replicas[0].client()
    for i in range(3):  # distinct prompts: cache_aware may send each to either replica
        prompt = f"{i} {PROMPT}"
        kwargs = dict(model=M, prompt=prompt, max_tokens=24, temperature=0, stream=stream)
        texts = [c.completions.create(**kwargs) for c in (routed, direct)]
        texts = [streamed_text(t, chat=False) if stream else t.choices[0].text for t in texts]
        assert texts[0] == texts[1] and texts[0]
        kwargs = dict(
            model=M, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0, stream=stream
        )
        texts = [c.chat.completions.create(**kwargs) for c in (routed, direct)]
        texts = [streamed_text(t, chat=True) if stream else t.choices[0].message.content for t in texts]
        assert texts[0] == texts[1] and texts[0]


def test_no_400_for_what_the_router_forwards(cluster):
    """The router's own fields at their defaults, and the same fields sent by a client."""
    routed, direct = cluster.router.client(), cluster.replicas[1].client()
    extra = {"ignore_eos": True, "skip_special_tokens": False, "top_k": 5, "min_tokens": 2, "repetition_penalty": 1.1}
    for kwargs in (
        dict(prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra),
        dict(prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0, n=2, logprobs=2, stop=["\n"], seed=1),
        dict(prompt=PROMPT, temperature=0, extra_body={"max_completion_tokens": 5, "ignore_eos": True}),
    ):
        answers = [c.completions.with_raw_response.create(model=M, **kwargs) for c in (routed, direct)]
        assert [a.status_code for a in answers] == [200, 200]
        texts = [[ch.text for ch in a.parse().choices] for a in answers]
        assert texts[0] == texts[1]
    for kwargs in (
        dict(messages=USER, max_tokens=8, temperature=0, extra_body=extra),
        dict(
            messages=USER,
            max_completion_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}, "include_reasoning": True},
        ),
        dict(messages=USER, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}),
    ):
        answers = [c.chat.completions.with_raw_response.create(model=M, **kwargs) for c in (routed, direct)]
        assert [a.status_code for a in answers] == [200, 200]
        if kwargs.get("stream"):
            texts = [streamed_text(a.parse(), chat=True) for a in answers]
        else:
            texts = [a.parse().choices[0].message.content for a in answers]
        assert texts[0] == texts[1]
    # cache_aware tokenizes each chat request on a worker first, through /tokenize.
    tokenized = httpx.post(
        f"{cluster.replicas[0].url}/tokenize", json={"model": M, "continue_final_message": False, "messages": USER}
    )
    assert tokenized.status_code == 200, tokenized.text


def test_structured_output_and_tools_pass_through(cluster):
    routed, direct = cluster.router.client(), cluster.replicas[0].client()
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    answers = [
        c.chat.completions.create(model=M, messages=USER, response_format=fmt, max_tokens=60, temperature=0)
        for c in (routed, direct)
    ]
    texts = [a.choices[0].message.content for a in answers]
    assert texts[0] == texts[1]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answers = [
            c.chat.completions.create(
                model=M, messages=USER, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=80, temperature=0
            )
            for c in (routed, direct)
        ]
        assert [a.choices[0].finish_reason for a in answers] == ["tool_calls", "tool_calls"]
        calls = [tool_calls(a) for a in answers]
        assert calls[0] == calls[1] and calls[0]
        for name, arguments in calls[0]:
            jsonschema.validate(arguments, {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}[name])


def test_vllm_gauges_rise_under_load_and_return_to_idle(cluster):
    """vllm:kv_cache_usage_perc counts blocks held by requests, as vLLM's does: a finished
    request's blocks stay in the prefix cache but are free, so usage goes back to 0."""
    url = cluster.replicas[1].url
    assert metrics(url) == {
        "vllm:num_requests_running": 0,
        "vllm:num_requests_waiting": 0,
        "vllm:kv_cache_usage_perc": 0,
    }
    body = {"model": M, "max_tokens": 400, "ignore_eos": True, "stream": True}
    readers = [
        StreamReader(f"{url}/v1/completions", {**body, "prompt": f"{i} {PROMPT}"}) for i in range(MAX_NUM_SEQS + 2)
    ]
    seen = []
    while any(r.thread.is_alive() for r in readers):
        seen.append(metrics(url))
        time.sleep(0.01)
    assert all(r.done for r in readers)
    assert max(s["vllm:num_requests_running"] for s in seen) == MAX_NUM_SEQS
    assert max(s["vllm:num_requests_waiting"] for s in seen) > 0
    assert 0 < max(s["vllm:kv_cache_usage_perc"] for s in seen) < 1
    deadline = time.monotonic() + 10
    while (now := metrics(url))["vllm:kv_cache_usage_perc"] or now["vllm:num_requests_running"]:
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    assert now == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0}


def test_a_replica_killed_mid_run_and_every_later_request_is_200(cluster):
    router = cluster.router.url
    # A long stream through the router; the replica serving it is the one killed.
    long = {"model": M, "prompt": f"killed {PROMPT}", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    victim_stream = StreamReader(f"{router}/v1/completions", long)
    assert victim_stream.first.wait(30) and victim_stream.status == 200
    running = [metrics(r.url)["vllm:num_requests_running"] for r in cluster.replicas]
    assert sorted(running) == [0, 1], running
    victim, survivor = (cluster.replicas[i] for i in ((0, 1) if running[0] else (1, 0)))
    # Another client's stream, on the replica that stays up.
    other = StreamReader(f"{survivor.url}/v1/completions", {**long, "prompt": PROMPT, "max_tokens": 300})
    assert other.first.wait(30)
    victim.proc.kill()
    victim.proc.wait(10)

    for i in range(10):  # completions and chat, whole and streamed
        prompt = f"after {i} {PROMPT}"
        path, body = (
            (CHAT, {"messages": [{"role": "user", "content": prompt}]}) if i % 2 else (CMPL, {"prompt": prompt})
        )
        body = {**body, "model": M, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": i % 4 < 2}
        reply = httpx.post(f"{router}{path}", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        if body["stream"]:
            assert reply.text.rstrip().endswith("data: [DONE]"), reply.text
        else:
            assert reply.json()["usage"]["completion_tokens"] == 8

    victim_stream.thread.join(30)
    other.thread.join(30)
    # The stream on the killed replica is cut (the router aborts the chunked body), not hung and
    # not replayed; the other client's stream finishes.
    assert not victim_stream.thread.is_alive() and not victim_stream.done
    assert isinstance(victim_stream.error, httpx.RemoteProtocolError), victim_stream.error
    assert other.done and other.error is None
    deadline = time.monotonic() + 10
    while (workers := router_workers(router))[victim.url]:  # the health checker's verdict
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)
    assert workers == {victim.url: False, survivor.url: True}
