"""POST /v1/responses through the official client (`client.responses.create` / `.stream`) over a
real socket: text and item inputs, instructions, max_output_tokens, json_schema output, function
tools and their outputs fed back, previous_response_id, typed stream events, and clear 400s."""

from __future__ import annotations

import json

import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from models.loader import load_model
from server.app import create_app
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.server.conftest import ENGINE_DEFAULTS, MODEL_NAME, LiveServer
from tests.server.test_validation import assert_openai_error

M = MODEL_NAME
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The tiny Llama with a 2048-token context: tool definitions take hundreds of tokens."""
    path = save_checkpoint(make_hf_model("llama", max_position_embeddings=2048), tmp_path_factory.mktemp("resp"))
    engine = AsyncEngine(
        load_model(path, dtype="float32", device="cpu"), EngineConfig(**{**ENGINE_DEFAULTS, "num_kv_blocks": 1024})
    )
    server = LiveServer(create_app(engine, served_model_name=MODEL_NAME), engine).start()
    yield server
    server.stop()


SUNNY = {
    "type": "object",
    "properties": {"sunny": {"type": "boolean"}},
    "required": ["sunny"],
    "additionalProperties": False,
}


def test_text_input_instructions_and_the_output_token_bound(live):
    client = live.client()
    done = client.responses.create(
        model=M, input="Hello", instructions="Be brief.", max_output_tokens=60, temperature=0
    )
    assert done.object == "response" and done.id.startswith("resp") and done.model == M
    cut = client.responses.create(
        model=M, input="Hello", max_output_tokens=3, temperature=0, extra_body={"metadata": {"run": "1"}}
    )
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.metadata == {"run": "1"}
    assert cut.usage.total_tokens == cut.usage.input_tokens + 3
    # instructions are a system turn in front: the prompt is longer with them
    plain = client.responses.create(model=M, input="Hello", max_output_tokens=1)
    assert done.usage.input_tokens > plain.usage.input_tokens
    assert [item.type for item in cut.output] == ["message"] and isinstance(cut.output_text, str)
    live.wait_idle()


def test_message_items_json_schema_output_and_tools_fed_back(live):
    client = live.client()
    items = [
        {"role": "developer", "content": "Answer in JSON."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Is it "}, {"type": "input_text", "text": "sunny?"}],
        },
    ]
    shaped = client.responses.create(
        model=M,
        input=items,
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SUNNY, "strict": True}},
    )
    assert set(json.loads(shaped.output_text)) == {"sunny"}
    called = client.responses.create(
        model=M, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", temperature=0, max_output_tokens=60
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    follow = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"},
    ]
    answered = client.responses.create(model=M, input=follow, tools=[WEATHER], max_output_tokens=8)
    assert answered.status in ("completed", "incomplete") and answered.usage.input_tokens > 20
    live.wait_idle()


def test_previous_response_id_continues_the_conversation_unless_not_stored(live):
    client = live.client()
    first = client.responses.create(model=M, input="My name is Ada.", max_output_tokens=5, temperature=0)
    alone = client.responses.create(model=M, input="What is my name?", max_output_tokens=5, temperature=0)
    second = client.responses.create(
        model=M, input="What is my name?", previous_response_id=first.id, max_output_tokens=5, temperature=0
    )
    # the second prompt holds the first turn and its answer
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 5
    assert second.previous_response_id == first.id
    unstored = client.responses.create(model=M, input="Hi", store=False, max_output_tokens=2)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as raised:
            client.responses.create(model=M, input="x", previous_response_id=missing, max_output_tokens=2)
        assert raised.value.body["param"] == "previous_response_id"
    live.wait_idle()


def test_stream_sends_typed_events_in_order_whose_deltas_make_the_text(live):
    client = live.client()
    short = {"format": {"type": "json_schema", "name": "yes_no", "schema": SUNNY}}  # ends well before the bound
    with client.responses.stream(model=M, input="Hello", max_output_tokens=60, temperature=0, text=short) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert (
        kinds[:4]
        == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        and kinds[-1] == "response.completed"
    )
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == final.output_text and final.status == "completed"
    whole = client.responses.create(model=M, input="Hello", max_output_tokens=60, temperature=0, text=short)
    assert whole.output_text == text and set(json.loads(text)) == {"sunny"}  # greedy: the same streamed or not
    # tool calls stream as function_call items with argument deltas
    with client.responses.stream(
        model=M,
        input="Weather?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        parallel_tool_calls=False,
        max_output_tokens=100,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and args == "".join(call.arguments for call in calls)
    assert "response.function_call_arguments.done" in [event.type for event in events]
    # at max_output_tokens the stream ends with response.incomplete
    with client.responses.stream(model=M, input="Hello", max_output_tokens=2) as stream:
        kinds = [event.type for event in stream]
    assert kinds[-1] == "response.incomplete"
    live.wait_idle()


@pytest.mark.parametrize(
    "body,param,says",
    [
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "not supported"),
        ({"input": [{"type": "input_image", "image_url": "http://x/y.png"}]}, "input[0].type", "not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
            "not supported",
        ),
        ({"input": []}, "input", "non-empty"),
        ({"input": "hi", "background": True}, "background", ""),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "not supported"),
        ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include", ""),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"input": "hi", "tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", "must be"),
        ({"input": "hi", "foo": 1}, "foo", "Unrecognized request argument"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(live, body, param, says):
    assert_openai_error(live.http.post("/v1/responses", json={"model": M, **body}), 400, param, says)


def test_an_output_bound_over_the_context_names_max_output_tokens(live):
    assert_openai_error(
        live.http.post("/v1/responses", json={"model": M, "input": "hi", "max_output_tokens": 10**6}),
        400,
        "max_output_tokens",
        "max_output_tokens is too large",
    )


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """The tiny Llama read with the deepseek_r1 parser: an output that never closes </think> is all
    thinking (the random model's text never writes the tag)."""
    path = save_checkpoint(make_hf_model("llama", max_position_embeddings=2048), tmp_path_factory.mktemp("think"))
    engine = AsyncEngine(load_model(path, dtype="float32", device="cpu"), EngineConfig(**ENGINE_DEFAULTS))
    server = LiveServer(
        create_app(engine, served_model_name=MODEL_NAME, reasoning_parser="deepseek_r1"), engine
    ).start()
    yield server
    server.stop()


def test_reasoning_is_an_item_of_its_own_whole_and_streamed(thinking):
    client = thinking.client()
    chat = (
        client.chat.completions.create(
            model=M, messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0
        )
        .choices[0]
        .message
    )
    assert chat.reasoning_content and not chat.content
    whole = client.responses.create(model=M, input="Hello", max_output_tokens=12, temperature=0)
    assert [item.type for item in whole.output] == ["reasoning"] and whole.status == "incomplete"
    item = whole.output[0]
    assert item.id.startswith("rs_") and item.summary == [] and item.content[0].type == "reasoning_text"
    assert item.content[0].text == chat.reasoning_content and whole.output_text == ""
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 12
    with client.responses.stream(model=M, input="Hello", max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "reasoning"
    assert kinds[-3:] == ["response.reasoning_text.done", "response.output_item.done", "response.incomplete"]
    assert set(kinds[3:-3]) == {"response.reasoning_text.delta"}
    final = events[-1].response
    streamed = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert streamed == events[-3].text == chat.reasoning_content == final.output[0].content[0].text
    assert final.usage.output_tokens_details.reasoning_tokens == 12
    # the item passed back as input (manual context management) is accepted, and dropped
    follow = client.responses.create(
        model=M,
        max_output_tokens=4,
        temperature=0,
        input=[
            {"role": "user", "content": "Hello"},
            item.model_dump(exclude_none=True),
            {"role": "user", "content": "More"},
        ],
    )
    assert follow.output and follow.output[0].type == "reasoning"
    thinking.wait_idle()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<think>abc</think>xyz", len("<think>abc</think>")),  # up to the token that completes </think>
        ("<think>abc", len("<think>abc")),  # never closed: every token
        ("plain answer", 0),
    ],
)
def test_reasoning_tokens_count_the_sampled_tokens_up_to_the_close(text, expected):
    from engine.request import SamplingParams
    from server.serving_common import Choice
    from server.serving_responses import _ResponsesView

    class Chars:  # one token a character
        @staticmethod
        def decode(ids, **_):
            return "".join(map(chr, ids))

    choice = Choice(0, "r", [], SamplingParams(), text_parts=[text], token_ids=[ord(c) for c in text])
    view = _ResponsesView("r", M, None, None, None, [], reasoning="qwen3", tokenizer=Chars())
    view._thought = "abc" if "<think>" in text else ""
    assert view._reasoning_tokens(choice) == expected
