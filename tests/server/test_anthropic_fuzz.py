"""Hostile Messages bodies against a live server: never a 5xx, every 4xx in Anthropic's error shape,
every stream ending with message_stop (or an error event that is not the server's fault), and the
server serves a normal request afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.server.test_fuzz import FUZZ, M, assert_still_serves, hostile_text, json_values, model, numbers, send

HI = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

text_block = st.fixed_dictionaries(
    {"type": st.just("text"), "text": hostile_text},
    optional={"cache_control": st.one_of(st.just({"type": "ephemeral"}), json_values)},
)
block = st.one_of(
    text_block,
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": hostile_text,
            "name": st.one_of(st.sampled_from(["get_weather", "bad name"]), hostile_text),
            "input": st.one_of(st.just({"city": "Paris"}), json_values),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": hostile_text},
        optional={
            "content": st.one_of(hostile_text, st.lists(text_block, max_size=2), json_values),
            "is_error": json_values,
        },
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(
                ["thinking", "redacted_thinking", "image", "document", "server_tool_use", "search_result"]
            )
        },
        optional={"thinking": hostile_text, "signature": json_values, "data": json_values, "source": json_values},
    ),
    json_values,
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), json_values),
        "content": st.one_of(hostile_text, st.lists(block, max_size=3), json_values),
    },
)
messages = st.one_of(st.just(HI), st.lists(message, max_size=3), json_values)
tool = st.one_of(
    st.fixed_dictionaries(
        {
            "name": st.sampled_from(["get_weather", "bad name", ""]),
            "input_schema": st.one_of(st.just(SCHEMA), json_values),
        },
        optional={
            "type": st.one_of(st.sampled_from(["custom", "bash_20250124"]), json_values),
            "description": hostile_text,
            "strict": json_values,
        },
    ),
    json_values,
)
tool_choice = st.one_of(
    st.fixed_dictionaries(
        {"type": st.one_of(st.sampled_from(["auto", "any", "tool", "none"]), json_values)},
        optional={"name": st.sampled_from(["get_weather", "nope"]), "disable_parallel_tool_use": json_values},
    ),
    json_values,
)
thinking = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled", "adaptive", "on"])}, optional={"budget_tokens": numbers}
    ),
    json_values,
)
FIELDS = {
    "system": st.one_of(hostile_text, st.lists(text_block, max_size=2), json_values),
    "tools": st.one_of(st.lists(tool, max_size=2), json_values),
    "tool_choice": tool_choice,
    "thinking": thinking,
}
message_bodies = st.fixed_dictionaries(
    {"model": model, "messages": messages},
    optional={
        **FIELDS,
        "max_tokens": st.one_of(st.integers(-1, 8), numbers),
        "stop_sequences": st.one_of(st.lists(hostile_text, max_size=5), json_values),
        "temperature": numbers,
        "top_p": numbers,
        "top_k": numbers,
        "stream": st.one_of(st.booleans(), json_values),
        "metadata": st.one_of(st.fixed_dictionaries({"user_id": hostile_text}), json_values),
        "output_config": json_values,
        "cache_control": json_values,
        "foo": json_values,
    },
)
# Mostly right: one request in a few is served, so rendering and streaming are reached too.
near_valid = st.fixed_dictionaries(
    {"model": st.just(M), "messages": st.one_of(st.just(HI), messages), "max_tokens": st.integers(1, 4)},
    optional={
        "stream": st.booleans(),
        "temperature": st.floats(0, 1),
        "stop_sequences": st.lists(hostile_text, max_size=2),
        "system": hostile_text,
        "tools": st.just([{"name": "get_weather", "input_schema": SCHEMA}]),
        "tool_choice": tool_choice,
        "thinking": thinking,
    },
)
count_bodies = st.fixed_dictionaries({"model": model, "messages": messages}, optional={**FIELDS, "foo": json_values})


def assert_anthropic_sound(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] != "api_error", body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in response.text.splitlines() if line]
        assert lines[-2] in ("event: message_stop", "event: error"), lines[-4:]
        assert '"api_error"' not in lines[-1], lines[-1]
    else:
        body = response.json()
        assert body.get("type") == "message" or set(body) == {"input_tokens"}, body


@pytest.mark.parametrize(
    "path,bodies",
    [("/v1/messages", st.one_of(message_bodies, near_valid)), ("/v1/messages/count_tokens", count_bodies)],
)
def test_hostile_messages_bodies_never_get_a_5xx_and_4xx_are_anthropic_errors(live, path, bodies):
    statuses: set[int] = set()

    @FUZZ
    @given(body=st.one_of(bodies, bodies, bodies, json_values))
    def case(body):
        response = send(live, path, body)
        statuses.add(response.status_code)
        assert_anthropic_sound(response)

    case()
    assert {200, 400} <= statuses, statuses  # both valid and refused requests were reached
    assert_still_serves(live)
    ok = live.http.post("/v1/messages", content=json.dumps({"model": M, "max_tokens": 2, "messages": HI}))
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= 2
