"""Each model family's tool-call format, read whole and in stream pieces of every size:
the pieces put together are always the whole reply."""

from __future__ import annotations

import json

import pytest

from server.tool_parsers import (
    PARSERS,
    DeepSeekV3Parser,
    HermesParser,
    JsonParser,
    Llama3JsonParser,
    MistralParser,
    ToolCallStream,
    hermes_messages,
    parser_for_template,
)

CASES = [
    (
        HermesParser(),
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "n": [1, 2]}}'
        '\n</tool_call>\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>',
        "Let me look.",
        [("get_weather", {"city": "Pa}ris", "n": [1, 2]}), ("noop", {})],
    ),
    (
        HermesParser(),
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        HermesParser(),
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        Llama3JsonParser(),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "noop", "parameters": {}}',
        None,
        [("get_weather", {"city": "Paris"}), ("noop", {})],
    ),
    (
        MistralParser(),
        'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": "[b]"}}, {"name": "g", "arguments": {}}]',
        "ok",
        [("f", {"a": "[b]"}), ("g", {})],
    ),
    (MistralParser(), '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', None, [("f", {"a": 1}), ("g", {})]),
    (
        DeepSeekV3Parser(),
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
        "noop\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Checking.",
        [("get_weather", {"city": "Paris"}), ("noop", {})],
    ),
    (
        JsonParser("get_weather"),
        '{"city": "Paris", "x": {"y": "}"}}',
        None,
        [("get_weather", {"city": "Paris", "x": {"y": "}"}})],
    ),
    (
        JsonParser(),
        '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]',
        None,
        [("f", {"a": 1}), ("g", {})],
    ),
]


def streamed(parser, text: str, step: int):
    stream = ToolCallStream(parser)
    content, calls = "", {}
    for end in [*range(step, len(text), step), len(text)]:
        piece, deltas = stream.feed(text[:end], final=end == len(text))
        content += piece
        for delta in deltas:
            if delta["index"] not in calls:
                assert delta["id"].startswith("call_") and delta["function"]["name"]  # name first, with the id
                calls[delta["index"]] = [delta["function"]["name"], ""]
            calls[delta["index"]][1] += delta["function"].get("arguments", "")
    return content, [(name, json.loads(args)) for name, args in calls.values()]


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=lambda c: getattr(c, "name", None))
def test_whole_and_streamed_replies_agree(parser, text, content, calls):
    whole_content, tool_calls = ToolCallStream(parser).final(text)
    assert whole_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls] == calls
    assert len({c["id"] for c in tool_calls}) == len(calls)
    for step in (1, 2, 3, 7, 1000):
        streamed_content, streamed_calls = streamed(parser, text, step)
        assert streamed_content.strip() == (content or "")
        assert streamed_calls == calls


@pytest.mark.parametrize("parser", [p() for p in PARSERS.values()], ids=lambda p: p.name)
def test_plain_text_is_content_and_nothing_is_held_back_at_the_end(parser):
    text = "Paris is the capital of France. {not a call} <tool and [TOOL"
    assert ToolCallStream(parser).final(text) == (text, [])
    content, calls = streamed(parser, text, 1)
    assert content == text and calls == []


def test_a_call_with_invalid_json_stays_content_and_parallel_false_keeps_one_call():
    broken = '<tool_call>{"name": "f", "arguments": {"a": </tool_call>'
    assert ToolCallStream(HermesParser()).final(broken) == (broken, [])
    text = CASES[0][1]
    _, calls = ToolCallStream(HermesParser(), max_calls=1).final(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_parser_for_template_and_hermes_fallback_messages():
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("[TOOL_CALLS]") == "mistral"
    assert parser_for_template("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert parser_for_template("<|python_tag|>") == "llama3_json"
    assert parser_for_template(None) == "hermes"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    out = hermes_messages(messages, tools)
    assert (
        out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and '"name": "f"' in out[0]["content"]
    )
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    assert hermes_messages(messages, [])[0] == messages[0]


def test_forced_calls_cut_off_by_max_tokens_keep_the_calls_they_completed():
    """tool_choice "required" at finish "length": the calls before the one cut short are returned
    as calls, not left as raw JSON in the content."""
    from server.tool_parsers import JsonParser

    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "f", "parameters": {"a": 2}}, {"name": "f", "param'
    content, calls = ToolCallStream(JsonParser()).final(text)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"a": 2}]
    # a call cut off alone, or garbage between calls, stays text
    assert ToolCallStream(JsonParser()).final('[{"name": "f", "parameters": {"a"')[1] == []
