"""Structured output and tool calls through the official openai client, on a live server.

The model is a tiny random Llama: whatever it would write, the grammar alone must make the
output valid, so every check here fails if the constraint is not applied."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from models.loader import load_model
from server.app import create_app
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.server.conftest import MODEL_NAME, LiveServer

M = MODEL_NAME
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "Tell me about a user."}]


class Address(BaseModel):
    zip: str = Field(pattern=r"^[0-9]{5}$")


class User(BaseModel):
    name: str = Field(pattern=r"^[a-z]{1,8}$")
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address


SCHEMAS = [
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,3}$"}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "outer": {
                "type": "object",
                "properties": {
                    "inner": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}
                },
                "required": ["inner"],
                "additionalProperties": False,
            }
        },
        "required": ["outer"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]},
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The tiny model with room for a tools prompt (the Hermes tool preamble is ~400 of its tokens).
    path = save_checkpoint(
        make_hf_model("llama", seed=3, max_position_embeddings=2048), tmp_path_factory.mktemp("structured-tiny-llama")
    )
    engine = AsyncEngine(
        load_model(path, dtype="float32", device="cpu"),
        EngineConfig(num_kv_blocks=512, block_size=8, max_num_seqs=16, max_num_batched_tokens=1024),
    )
    live = LiveServer(create_app(engine, served_model_name=M), engine).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model_returns_validated_objects(client, temperature):
    for seed in (1, 2):
        completion = client.chat.completions.parse(
            model=M, messages=USER, response_format=User, n=2, temperature=temperature, seed=seed, max_tokens=200
        )
        assert len(completion.choices) == 2
        for choice in completion.choices:
            assert choice.finish_reason == "stop"
            assert isinstance(choice.message.parsed, User)


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_json_schema_outputs_validate(client, schema):
    for stream in (False, True):
        kwargs = dict(
            model=M,
            messages=USER,
            temperature=1.0,
            seed=11,
            max_tokens=150,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}},
        )
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(stream=True, **kwargs)
                if c.choices
            )
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)


def test_json_object_gives_an_object(client):
    # Any object: on a random model it may not close within max_tokens, so check its start.
    out = client.chat.completions.create(
        model=M, messages=USER, response_format={"type": "json_object"}, max_tokens=10, temperature=1.0, seed=2
    )
    assert out.choices[0].message.content.startswith("{")


def test_vllm_fields_on_completions_and_chat(client):
    regex = r"[a-c]{2,4}-[0-9]{3}"
    out = client.completions.create(model=M, prompt="code:", max_tokens=20, seed=1, extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    out = client.chat.completions.create(
        model=M, messages=USER, max_tokens=20, seed=2, extra_body={"guided_choice": ["yes", "no", "maybe"]}
    )
    assert out.choices[0].message.content in ("yes", "no", "maybe")
    out = client.completions.create(
        model=M,
        prompt="x",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")'}},
    )
    assert out.choices[0].text in ("ab", "ac")
    out = client.completions.create(
        model=M, prompt="x", max_tokens=50, seed=3, extra_body={"guided_json": json.dumps(SCHEMAS[0])}
    )
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS[0])
    chunks = client.completions.create(
        model=M, prompt="x", max_tokens=20, seed=4, stream=True, extra_body={"structured_outputs": {"regex": regex}}
    )
    assert re.fullmatch(regex, "".join(c.choices[0].text for c in chunks if c.choices))


def test_constrained_and_unconstrained_requests_share_batches(server, client):
    plain = dict(model=M, prompt="hello there", max_tokens=16, temperature=1.0, seed=5)
    alone = client.completions.create(**plain).choices[0].text
    results: dict[int, str] = {}

    def constrained(i: int) -> None:
        out = client.completions.create(
            model=M, prompt="x", max_tokens=60, seed=i, extra_body={"guided_json": SCHEMAS[3]}
        )
        results[i] = out.choices[0].text

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    mixed = client.completions.create(**plain).choices[0].text
    for t in threads:
        t.join()
    assert mixed == alone
    for text in results.values():
        jsonschema.validate(json.loads(text), SCHEMAS[3])
    server.wait_idle()
    # Six requests, one schema: compiled once.
    assert server.metric("pagedserve:num_structured_output_requests_total") >= 6
    assert server.metric("pagedserve:num_grammars_compiled_total") < server.metric(
        "pagedserve:num_structured_output_requests_total"
    )


def test_bad_grammars_are_400s_and_the_server_serves_on(server, client):
    bad = [
        {"guided_json": {"type": "object", "properties": {"a": {"type": "wat"}}}},
        {"guided_regex": "(unclosed"},
        {"guided_grammar": "root ::= missing"},
        {"structured_outputs": {"json": {"type": "string", "pattern": "(?<=x)y"}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=M, prompt="x", max_tokens=5, extra_body=extra)
        assert err.value.body["param"].startswith(next(iter(extra)))
    # Large but legal: compiled within its bounds, or refused; never a hang or a 500.
    huge = {
        "type": "object",
        "properties": {f"k{i}": {"type": "string", "pattern": "^(a|b){1,50}c{1,50}$"} for i in range(300)},
    }
    response = server.http.post(CMPL, json={"model": M, "prompt": "x", "max_tokens": 3, "guided_json": huge})
    assert response.status_code in (200, 400), response.text
    assert client.completions.create(model=M, prompt="x", max_tokens=3).choices[0].finish_reason == "length"
    server.wait_idle()


def _stream_tool_calls(client, **kwargs):
    """A streamed reply put back together: (content, {index: (id, name, arguments)}, finish_reason)."""
    content, calls, finish, first_delta = "", {}, None, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            if delta.index not in calls:
                assert delta.id and delta.function.name  # the name comes first, with the id
                first_delta[delta.index] = delta
                calls[delta.index] = [delta.id, delta.function.name, ""]
            calls[delta.index][2] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, {i: tuple(c) for i, c in calls.items()}, finish


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_round_trip(client, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(
        model=M,
        tools=[WEATHER, TIME],
        max_tokens=80,
        temperature=1.0,
        seed=7,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    if stream:
        _, calls, finish = _stream_tool_calls(client, messages=messages, **kwargs)
        call_id, name, arguments = calls[0]
    else:
        reply = client.chat.completions.create(messages=messages, **kwargs).choices[0]
        finish, call = reply.finish_reason, reply.message.tool_calls[0]
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert finish == "tool_calls" and name == "get_weather" and call_id.startswith("call_")
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    # The call and its result go back; the model answers (constrained to a choice here).
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'},
    ]
    final = client.chat.completions.create(
        model=M,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_tokens=10,
        extra_body={"guided_choice": ["warm", "cold"]},
    )
    assert final.choices[0].message.content in ("warm", "cold") and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_calls_listed_tools_with_valid_arguments(client, parallel):
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for seed in range(3):
        kwargs = dict(
            model=M,
            messages=USER,
            tools=list(tools.values()),
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            parallel_tool_calls=parallel,
        )
        reply = client.chat.completions.create(**kwargs).choices[0]
        assert reply.finish_reason == "tool_calls", reply
        calls = reply.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(
                json.loads(call.function.arguments), tools[call.function.name]["function"]["parameters"]
            )
        _, streamed, finish = _stream_tool_calls(client, **kwargs)
        assert finish == "tool_calls"
        assert [(n, json.loads(a)) for _, n, a in streamed.values()] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ]


def test_auto_tool_choice_parses_what_the_model_wrote(client):
    # A random model rarely writes a call: forcing the Hermes format with a grammar shows the
    # auto path's parser (content before the call, the call itself, finish_reason).
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    kwargs = dict(
        model=M,
        messages=USER,
        tools=[WEATHER, TIME],
        max_tokens=120,
        extra_body={"guided_regex": "Sure[.] " + re.escape(call)},
    )
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert reply.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls] == [
        ("get_time", {"tz": "UTC"})
    ]
    content, calls, finish = _stream_tool_calls(client, **kwargs)
    assert content.strip() == "Sure." and finish == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [("get_time", {"tz": "UTC"})]
    # Without a call the reply is plain content.
    plain = client.chat.completions.create(
        model=M, messages=USER, tools=[WEATHER], max_tokens=40, extra_body={"guided_choice": ["no tools needed"]}
    ).choices[0]
    assert plain.message.content == "no tools needed" and not plain.message.tool_calls
    assert plain.finish_reason == "stop"


def test_tokenize_renders_tools_and_tool_turns_as_chat_does(server):
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    counted = server.http.post("/tokenize", json={"model": M, "messages": messages, "tools": [TIME]}).json()
    chat = server.http.post(CHAT, json={"model": M, "messages": messages, "tools": [TIME], "max_tokens": 1}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"]
    text = server.http.post("/detokenize", json={"model": M, "tokens": counted["tokens"]}).json()["prompt"]
    assert '"name": "get_time"' in text and "<tool_response>\n12:00\n</tool_response>" in text
