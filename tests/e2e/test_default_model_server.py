"""End to end: `python -m server` with no --model (the default SmolLM2-135M-Instruct, dtype auto),
driven by the official openai client over a real socket."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.docs.runnable_blocks import documents, runnable
from tests.server.conftest import served

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def server():
    from models.fetch import default_model_path

    default_model_path()  # fetch (once) before the clock starts
    with served("--max-model-len", "2048", "--kv-cache-memory", "0.25", "--log-level", "warning") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def test_default_model_is_served_under_its_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_answers_and_stream_matches(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    answer = whole.choices[0].message.content
    assert "Paris" in answer
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]


def test_completion_stream_matches_and_stop_and_logprobs(client):
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=2)
    text = whole.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == text and len(lp.tokens) == whole.usage.completion_tokens
    assert all(
        max(top.values()) == pytest.approx(logprob, abs=1e-4)
        for top, logprob in zip(lp.top_logprobs, lp.token_logprobs)
    )
    assert "Paris" in text
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=["Paris"])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index("Paris")]


def test_sampling_with_seed_and_n(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a short poem about the sea."}],
        max_tokens=20,
        temperature=0.9,
        top_p=0.95,
        seed=42,
    )
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
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = first.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == first.choices[0].message.content
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 16 > 0


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: float = Field(ge=0, le=50)
    landmarks: list[str] = Field(max_length=3)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


def test_parse_returns_validated_objects_from_the_real_model(client):
    messages = [
        {
            "role": "user",
            "content": "Describe Paris as JSON: name, country, population in millions, "
            "up to three landmarks and its continent.",
        }
    ]
    for temperature, seed in ((0.0, None), (0.8, 1), (0.8, 2)):
        parsed = (
            client.chat.completions.parse(
                model=MODEL, messages=messages, response_format=City, max_tokens=150, temperature=temperature, seed=seed
            )
            .choices[0]
            .message.parsed
        )
        assert isinstance(parsed, City)
    assert parsed.continent in City.model_fields["continent"].annotation.__args__


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_on_the_real_model(client, stream):
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    kwargs = dict(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=80, temperature=0)
    if stream:
        calls: dict[int, list[str]] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for delta in chunk.choices[0].delta.tool_calls or ():
                entry = calls.setdefault(delta.index, [delta.id, delta.function.name, ""])
                entry[2] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        call_id, name, arguments = calls[0]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish, call = choice.finish_reason, choice.message.tool_calls[0]
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert finish == "tool_calls" and name == "get_weather"
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and "Paris" in args["city"]
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=40, temperature=0
    ).choices[0]
    assert answer.message.content and not answer.message.tool_calls


def test_the_readme_structured_output_examples_run_verbatim_and_finish(server):
    """The README's `parse(City)` and tool-call blocks, as written (default temperature, no
    max_tokens), 10 and 3 times: each ends by itself, with a City and a tool call. Number,
    string and array lengths are bounded in the grammar (engine/structured.py: `bounded`), so a
    float's digits cannot run to the end of the context as they once did. The tool block asks for
    one call (`parallel_tool_calls=False`): with up to 16, one first reply in ~120 ran to ~3.8k
    tokens of calls, and its follow-up was over this server's --max-model-len (a rightful 400)."""
    city_block, tool_block = (
        b.against(server) for b in runnable(REPO / "README.md", "Structured output and tool calls")
    )
    # parse() raises when a reply ends at the length limit; the tool block's answer is checked below
    for block, runs in ((city_block, 10), (tool_block, 3)):
        scope: dict = {}
        for _ in range(runs):
            exec(city_block, scope)  # the client (and City) as the README builds them
            if block is tool_block:
                try:
                    exec(tool_block, scope)
                except TypeError:  # no tool_calls: say what came back instead
                    reply = scope.get("reply")
                    raise AssertionError(
                        f"no tool call: {reply.finish_reason if reply else None} "
                        f"{(reply.message.content or '')[:500] if reply else ''!r}"
                    ) from None
                assert scope["call"].function.name == "get_weather"
                assert set(json.loads(scope["call"].function.arguments)) <= {"city"}
                # a free reply at the default temperature may ramble: it ends by itself or at the block's
                # max_tokens, never cut short by the context
                answer = scope["answer"]
                assert answer.choices[0].finish_reason in ("stop", "tool_calls") or (
                    answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 256
                ), answer
            assert type(scope["city"]).__name__ == "City"


@pytest.mark.parametrize("document", [d for d in documents() if runnable(d)], ids=lambda d: d.name)
def test_the_docs_runnable_blocks_run_as_written(server, document):
    """Every block marked `<!-- runnable -->` (tests/docs/runnable_blocks.py), in order, as a reader
    pastes it against `make serve`'s server: Python in one scope per file, shell in bash with
    errors fatal. A curl that prints JSON must print no error object."""
    scope: dict = {}
    for block in runnable(document):
        code = block.against(server)
        if block.language == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    exec(compile(code, block.where(), "exec"), scope)
                except Exception as error:
                    raise AssertionError(f"{block.where()} failed: {error!r}") from error
        else:
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
            )
            assert done.returncode == 0, f"{block.where()}: exit {done.returncode}: {done.stderr[-2000:]}"
            if done.stdout.lstrip().startswith("{"):
                body = json.loads(done.stdout)
                assert "error" not in body, f"{block.where()}: {body}"
