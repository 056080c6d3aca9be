"""End to end: `python -m server --model qwen2.5-coder-0.5b-instruct`, the real Qwen2.5 Coder 0.5B
(Q4_K_M GGUF) by its catalogue name, through the official openai client: a chat answer, and tool
calls read in Qwen's own `<tool_call>` format (the hermes parser, picked from the chat template)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.conftest import QWEN05 as MODEL
from tests.server.conftest import free_port, stop_server, wait_healthy

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # loads a 0.5B model and decodes on the CPU

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(qwen05_servable, tmp_path_factory):
    """(URL, the server's log file): 127.0.0.1 on a free port, stopped by its own handle."""
    port = free_port()
    log = tmp_path_factory.mktemp("qwen-server") / "server.log"
    with open(log, "w") as out:  # a file, not a pipe nobody reads: info-level logs would fill one
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server",
                "--model",
                MODEL,
                "--port",
                str(port),
                "--max-model-len",
                "4096",
                "--kv-cache-memory",
                "0.25",
                "--log-level",
                "info",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=900, output=log.read_text)
        yield url, log
    finally:
        stop_server(proc, log.read_text)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=600)


def test_served_under_its_catalogue_name_with_qwens_tool_format(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert "tool calls are read with the hermes parser" in server[1].read_text()


def test_chat_answers_with_code(client):
    reply = client.chat.completions.create(
        model=MODEL,
        max_tokens=96,
        temperature=0,
        messages=[{"role": "user", "content": "Write a Python function square(x) that returns x squared."}],
    )
    choice = reply.choices[0]
    assert "def square" in choice.message.content, choice.message.content
    assert choice.finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_a_forced_tool_call_is_parsed(client, tool_choice):
    choice = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=tool_choice, max_tokens=60, temperature=0
    ).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and "Paris" in arguments["city"], arguments


def test_the_models_own_tool_call_is_parsed_without_a_grammar(client):
    """tool_choice auto: nothing forces the output. This model writes the call as a bare JSON object
    rather than inside the <tool_call> tags its template shows (transformers' float32 greedy output
    does the same); the hermes parser reads both, and no tag or JSON is left in the content."""
    choice = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=60, temperature=0
    ).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert "Paris" in json.loads(call.function.arguments)["city"]
    assert "<tool_call>" not in (choice.message.content or "") and "get_weather" not in (choice.message.content or "")
