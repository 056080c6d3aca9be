"""LangChain's ChatAnthropic against a live server's Messages API (real socket): invoke and stream
agree, `bind_tools(..., tool_choice="any")` always returns calls that fit the tool, and a wrong
model name is anthropic's NotFoundError. The tiny random model writes gibberish: only the grammar
makes the calls valid, which is the point."""

from __future__ import annotations

from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from models.loader import load_model
from server.app import create_app
from tests.models.conftest import make_hf_model, save_checkpoint
from tests.server.conftest import ENGINE_DEFAULTS, MODEL_NAME, LiveServer

langchain_anthropic = pytest.importorskip("langchain_anthropic")
anthropic = pytest.importorskip("anthropic")


class GetWeather(BaseModel):
    """The weather forecast for a city."""

    city: Literal["Paris", "Rome", "Oslo"] = Field(description="the city")
    days: int = Field(ge=1, le=7, description="how many days ahead")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The tiny Llama with a 2048-token context: tool definitions take hundreds of tokens."""
    path = save_checkpoint(make_hf_model("llama", max_position_embeddings=2048), tmp_path_factory.mktemp("lca"))
    engine = AsyncEngine(
        load_model(path, dtype="float32", device="cpu"), EngineConfig(**{**ENGINE_DEFAULTS, "num_kv_blocks": 1024})
    )
    server = LiveServer(create_app(engine, served_model_name=MODEL_NAME), engine).start()
    yield server
    server.stop()


def chat(live: LiveServer, **kwargs):
    return langchain_anthropic.ChatAnthropic(
        base_url=live.url, api_key="unused", model=MODEL_NAME, max_retries=0, timeout=60, **{"temperature": 0, **kwargs}
    )


def test_invoke_and_stream_give_the_same_answer(live):
    llm = chat(live, max_tokens=12)
    whole = llm.invoke("Hello")
    chunks = list(llm.stream("Hello"))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert whole.text and streamed.text == whole.text
    assert whole.usage_metadata["output_tokens"] == 12
    assert whole.response_metadata["stop_reason"] == "max_tokens"


def test_forced_tool_calls_always_fit_the_tool(live):
    schema = {**GetWeather.model_json_schema(), "additionalProperties": False}
    llm = chat(live, max_tokens=100, temperature=1.0)
    for tool_choice in ("any", "GetWeather"):
        bound = llm.bind_tools([GetWeather], tool_choice=tool_choice)
        for draw in range(8):
            message = bound.invoke("What is the weather in Paris?")
            assert message.tool_calls, f"{tool_choice}, draw {draw}: no tool call ({message.content!r})"
            for call in message.tool_calls:
                assert call["name"] == "GetWeather"
                jsonschema.validate(call["args"], schema)


def test_a_streamed_tool_call_adds_up_to_a_valid_call(live):
    bound = chat(live, max_tokens=100).bind_tools([GetWeather], tool_choice="GetWeather")
    streamed = None
    for chunk in bound.stream("What is the weather in Rome?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [call["name"] for call in streamed.tool_calls] == ["GetWeather"]
    schema = {**GetWeather.model_json_schema(), "additionalProperties": False}
    jsonschema.validate(streamed.tool_calls[0]["args"], schema)
    assert streamed.response_metadata["stop_reason"] == "tool_use"


def test_a_wrong_model_name_is_not_found_with_our_message(live):
    llm = langchain_anthropic.ChatAnthropic(base_url=live.url, api_key="unused", model="claude-nope", max_retries=0)
    with pytest.raises(anthropic.NotFoundError, match="claude-nope"):
        llm.invoke("hi")
