"""POST /v1/messages and /v1/messages/count_tokens through the official `anthropic` client over a
real socket: text, system, sampling fields, stop sequences and max_tokens, usage with the prefix
cache's reads, the stream's events and the client's stream helpers, Anthropic-shaped errors
(4xx, never 5xx), images and documents refused by name, and x-api-key."""

from __future__ import annotations

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from models.loader import load_model
from server.app import create_app
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.server.conftest import ENGINE_DEFAULTS, MODEL_NAME, LiveServer

anthropic = pytest.importorskip("anthropic")

M = MODEL_NAME
HELLO = [{"role": "user", "content": "Hello"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The tiny Llama with a 2048-token context: tool definitions take hundreds of tokens."""
    path = save_checkpoint(make_hf_model("llama", max_position_embeddings=2048), tmp_path_factory.mktemp("msgs"))
    engine = AsyncEngine(
        load_model(path, dtype="float32", device="cpu"), EngineConfig(**{**ENGINE_DEFAULTS, "num_kv_blocks": 1024})
    )
    server = LiveServer(create_app(engine, served_model_name=M), engine).start()
    yield server
    server.stop()


def client(live: LiveServer, **kwargs) -> anthropic.Anthropic:
    kwargs.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=live.url, max_retries=0, timeout=60, **kwargs)


def assert_anthropic_error(
    response: httpx.Response, status: int, contains: str = "", kind: str = "invalid_request_error"
) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and contains in body["error"]["message"], body
    return body["error"]["message"]


def test_create_with_system_reports_the_message_and_its_usage(live):
    c = client(live)
    # temperature, top_p and top_k: the API takes them; this client sends them as extra fields
    message = c.messages.create(
        model=M,
        max_tokens=8,
        system="Be brief.",
        messages=HELLO,
        metadata={"user_id": "someone"},
        extra_body={"temperature": 0, "top_p": 0.9, "top_k": 40},
    )
    assert message.type == "message" and message.role == "assistant" and message.model == M
    assert message.id.startswith("msg_") and [b.type for b in message.content] == ["text"]
    assert message.stop_reason in ("max_tokens", "end_turn") and message.stop_sequence is None
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 8
    counted = c.messages.count_tokens(model=M, system="Be brief.", messages=HELLO).input_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted
    plain = c.messages.count_tokens(model=M, messages=HELLO).input_tokens
    assert counted > plain  # the system turn is in the prompt
    # system as text blocks renders as the string does
    blocks = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    assert c.messages.count_tokens(model=M, system=blocks, messages=HELLO).input_tokens == counted
    live.wait_idle()


def test_a_repeated_prompt_is_read_from_the_prefix_cache(live):
    c = client(live)
    long_prompt = [{"role": "user", "content": "Tell me about the sea and the sky. " * 8}]
    first = c.messages.create(model=M, max_tokens=1, messages=long_prompt)
    second = c.messages.create(model=M, max_tokens=1, messages=long_prompt)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    live.wait_idle()


def test_max_tokens_and_stop_sequences_end_the_message(live):
    c = client(live)
    whole = c.messages.create(model=M, max_tokens=24, messages=HELLO, extra_body=GREEDY)
    text = whole.content[0].text
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 24, whole
    stop = text[4:7]
    cut = c.messages.create(
        model=M, max_tokens=24, messages=HELLO, extra_body=GREEDY, stop_sequences=["\x00never", stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]
    live.wait_idle()


def test_create_and_stream_give_the_same_text(live):
    c = client(live)
    kwargs = dict(model=M, max_tokens=16, messages=HELLO, extra_body=GREEDY)
    whole = c.messages.create(**kwargs)
    with c.messages.stream(**kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )
    live.wait_idle()


def test_the_stream_sends_anthropics_events_in_order(live):
    events = list(client(live).messages.create(model=M, max_tokens=6, messages=HELLO, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1:3] == ["content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.content == [] and events[0].message.usage.output_tokens == 0
    assert events[-2].delta.stop_reason in ("max_tokens", "end_turn") and events[-2].usage.output_tokens <= 6
    with httpx.stream(
        "POST", f"{live.url}/v1/messages", json={"model": M, "max_tokens": 2, "messages": HELLO, "stream": True}
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[:4] == [lines[0], lines[1], "event: ping", 'data: {"type":"ping"}']
    assert lines[-2:] == ["event: message_stop", 'data: {"type":"message_stop"}']  # no [DONE]
    live.wait_idle()


@pytest.mark.parametrize(
    "block,name",
    [
        ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}, "image"),
        ({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}}, "document"),
    ],
)
def test_images_and_documents_are_refused_by_name(live, block, name):
    content = [{"type": "text", "text": "What is this?"}, block]
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(live).messages.create(model=M, max_tokens=4, messages=[{"role": "user", "content": content}])
    assert raised.value.status_code == 400 and name in raised.value.message
    assert "messages[0].content[1].type" in raised.value.message
    assert raised.value.body["error"]["type"] == "invalid_request_error"


BAD = [
    ({"messages": HELLO}, "max_tokens"),  # required, as Anthropic requires it
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 4, "temperature": 1.5}, "temperature"),
    ({"messages": HELLO, "max_tokens": 4, "top_p": 0}, "top_p"),
    ({"messages": HELLO, "max_tokens": 4, "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": HELLO, "max_tokens": 4, "stop_sequences": ["a"] * 5}, "stop_sequences"),
    ({"messages": HELLO, "max_tokens": 10**6}, "max_tokens"),
    ({"messages": [], "max_tokens": 4}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": []}], "max_tokens": 4}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 4}, "messages[0].content[0].text"),
    ({"messages": HELLO + [{"role": "assistant", "content": "Sure"}], "max_tokens": 4}, "messages[1].role"),
    ({"messages": HELLO, "max_tokens": 4, "frequency_penalty": 1}, "frequency_penalty"),
    ({"messages": HELLO, "max_tokens": 4, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"messages": HELLO, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 4}}, "budget_tokens"),
    (
        {"messages": HELLO, "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "tools[0].type",
    ),
]


@pytest.mark.parametrize("body,names", BAD, ids=[names for _, names in BAD])
def test_bad_requests_are_400s_in_anthropics_shape_naming_the_field(live, body, names):
    assert_anthropic_error(live.http.post("/v1/messages", json={"model": M, **body}), 400, names)


def test_other_errors_on_these_routes_are_in_anthropics_shape(live):
    http = live.http
    assert_anthropic_error(
        http.post("/v1/messages", json={"model": "claude-x", "max_tokens": 4, "messages": HELLO}),
        404,
        "claude-x",
        kind="not_found_error",
    )
    assert_anthropic_error(http.get("/v1/messages"), 405, "GET is not allowed")
    assert_anthropic_error(http.post("/v1/messages", content=b"{"), 400, "not valid JSON")
    assert_anthropic_error(http.post("/v1/messages/count_tokens", json={"model": M}), 400, "messages")
    with pytest.raises(anthropic.NotFoundError, match="claude-x"):
        client(live).messages.create(model="claude-x", max_tokens=4, messages=HELLO)
    # the OpenAI routes keep OpenAI's shape
    assert set(http.post("/v1/chat/completions", json={"model": M}).json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


def test_x_api_key_and_anthropic_version_are_accepted(start_server):
    live = start_server(app_kwargs={"api_key": "sekret"})
    message = client(live, api_key="sekret").messages.create(model=M, max_tokens=2, messages=HELLO)
    assert message.usage.output_tokens <= 2
    bearer = client(live, api_key=None, auth_token="sekret")  # Authorization: Bearer, as on the OpenAI routes
    assert bearer.messages.count_tokens(model=M, messages=HELLO).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as raised:
        client(live, api_key="wrong").messages.create(model=M, max_tokens=2, messages=HELLO)
    assert raised.value.body["error"]["type"] == "authentication_error"
    response = live.http.post(
        "/v1/chat/completions", headers={"x-api-key": "sekret"}, json={"model": M, "messages": HELLO, "max_tokens": 1}
    )
    assert response.status_code == 200  # x-api-key opens the OpenAI routes too


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize(
    "tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "by name"]
)
def test_a_forced_tool_call_is_valid_every_time_and_its_result_is_answered(live, tool_choice):
    jsonschema = pytest.importorskip("jsonschema")
    c = client(live)
    schema = {**WEATHER["input_schema"], "additionalProperties": False}
    for draw in range(8):  # the tiny random model writes gibberish: only the grammar makes the call valid
        message = c.messages.create(
            model=M,
            max_tokens=100,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=tool_choice,
            extra_body={"temperature": 1.0},
        )
        calls = [b for b in message.content if b.type == "tool_use"]
        # "any" lets the model call again and again: cut at max_tokens, the calls it finished stand
        assert calls and message.stop_reason in ("tool_use", "max_tokens"), f"draw {draw}: {message.content}"
        for call in calls:
            assert call.name == "get_weather" and call.id.startswith("toolu_")
            jsonschema.validate(call.input, schema)
    results = [
        {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny, 21 C"}]}
        for call in calls
    ]
    follow = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        {"role": "user", "content": results + [{"type": "text", "text": "So?"}]},
    ]
    answer = c.messages.create(model=M, max_tokens=8, messages=follow, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = c.messages.count_tokens(model=M, messages=follow, tools=[WEATHER]).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted
    assert counted > c.messages.count_tokens(model=M, messages=ASK, tools=[WEATHER]).input_tokens + 20
    live.wait_idle()


def test_a_streamed_tool_call_arrives_as_input_json_deltas(live):
    c = client(live)
    kwargs = dict(
        model=M, max_tokens=100, messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    with c.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["tool_use"] and starts[0].input == {}
    assert len(pieces) > 1 and all(isinstance(p, str) for p in pieces)
    import json

    assert json.loads("".join(pieces)) == final.content[0].input
    assert final.stop_reason == "tool_use" and final.content[0].name == "get_weather"
    assert set(final.content[0].input) == {"city", "days"}
    live.wait_idle()


def test_tool_choice_none_auto_and_one_call_at_most(live):
    c = client(live)
    without = c.messages.count_tokens(model=M, messages=ASK).input_tokens
    # none: the tools are not shown to the model and no call is read back
    assert (
        c.messages.count_tokens(model=M, messages=ASK, tools=[WEATHER], tool_choice={"type": "none"}).input_tokens
        == without
    )
    assert c.messages.count_tokens(model=M, messages=ASK, tools=[WEATHER]).input_tokens > without
    none = c.messages.create(model=M, max_tokens=8, messages=ASK, tools=[WEATHER], tool_choice={"type": "none"})
    assert all(b.type == "text" for b in none.content) and none.stop_reason != "tool_use"
    auto = c.messages.create(model=M, max_tokens=8, messages=ASK, tools=[WEATHER], tool_choice={"type": "auto"})
    assert auto.stop_reason in ("end_turn", "max_tokens", "tool_use")
    one = c.messages.create(
        model=M,
        max_tokens=200,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert len([b for b in one.content if b.type == "tool_use"]) == 1
    live.wait_idle()


def test_a_json_output_format_is_followed(live):
    schema = {
        "type": "object",
        "properties": {"sunny": {"type": "boolean"}},
        "required": ["sunny"],
        "additionalProperties": False,
    }
    message = client(live).messages.create(
        model=M,
        max_tokens=40,
        messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    import json

    assert set(json.loads(message.content[0].text)) == {"sunny"}


TOOL_BAD = [
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "nope"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
        "messages[0].content[0]",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}
                    ],
                }
            ]
        },
        "messages[0].content[0].content[0].type",
    ),
]


@pytest.mark.parametrize("fields,names", TOOL_BAD, ids=[names for _, names in TOOL_BAD])
def test_bad_tools_are_400s_naming_the_field(live, fields, names):
    body = {"model": M, "max_tokens": 4, "messages": ASK, **fields}
    assert_anthropic_error(live.http.post("/v1/messages", json=body), 400, names)


@pytest.fixture(scope="module")
def thinking_live(tmp_path_factory):
    """The tiny Llama read with the deepseek_r1 reasoning parser: the prompt opened <think>, and the
    random model never closes it, so all of its output is thinking."""
    path = save_checkpoint(make_hf_model("llama", max_position_embeddings=2048), tmp_path_factory.mktemp("think"))
    engine = AsyncEngine(
        load_model(path, dtype="float32", device="cpu"), EngineConfig(**{**ENGINE_DEFAULTS, "num_kv_blocks": 1024})
    )
    server = LiveServer(create_app(engine, served_model_name=M, reasoning_parser="deepseek_r1"), engine).start()
    yield server
    server.stop()


def test_thinking_comes_as_thinking_blocks_whole_and_streamed(thinking_live):
    c = client(thinking_live)
    kwargs = dict(
        model=M, max_tokens=12, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 8}, extra_body=GREEDY
    )
    whole = c.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].thinking
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    with c.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and {d.type for d in deltas} == {"thinking_delta"}
    assert "".join(d.thinking for d in deltas) == whole.content[0].thinking == final.content[0].thinking
    assert c.messages.create(**{**kwargs, "thinking": {"type": "adaptive"}}).content[0].type == "thinking"
    thinking_live.wait_idle()


def test_earlier_thinking_passed_back_is_dropped_from_the_prompt(thinking_live):
    c = client(thinking_live)
    turn = [
        {"type": "thinking", "thinking": "Let me think about this at length.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "Hi!"},
    ]
    with_thinking = HELLO + [{"role": "assistant", "content": turn}, {"role": "user", "content": "And?"}]
    without = HELLO + [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "And?"}]
    assert (
        c.messages.count_tokens(model=M, messages=with_thinking).input_tokens
        == c.messages.count_tokens(model=M, messages=without).input_tokens
    )
    assert c.messages.create(model=M, max_tokens=2, messages=with_thinking, thinking={"type": "disabled"}).usage


def test_a_failure_mid_stream_is_an_error_event(start_server):
    live = start_server()
    generate = live.engine.generate

    async def failing_generate(*args, **kwargs):
        async for output in generate(*args, **kwargs):
            yield output
            raise RuntimeError("the engine broke")

    live.engine.generate = failing_generate
    body = {"model": M, "max_tokens": 8, "messages": HELLO, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/messages", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[0] == "event: message_start" and lines[-2] == "event: error", lines
    assert '"type":"api_error"' in lines[-1] and "the engine broke" in lines[-1]
    with pytest.raises(anthropic.APIStatusError, match="the engine broke"):
        list(client(live).messages.create(**{**body, "stream": True}))


def test_a_client_finds_the_server_through_anthropic_base_url(live, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_BASE_URL", live.url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "unused")
    message = anthropic.Anthropic(max_retries=0).messages.create(model=M, max_tokens=2, messages=HELLO)
    assert message.model == M and message.usage.output_tokens <= 2
