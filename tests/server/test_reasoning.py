"""Reasoning (<think>...</think>) returned as reasoning_content apart from content: the parsers whole
and streamed in pieces of every size, the choice from the chat template, and over a socket with
the official client, whole and streamed."""

from __future__ import annotations

import json

import pytest

from server.reasoning import ReasoningStream, parser_for_template, split
from tests.server.conftest import MODEL_NAME

CASES = [
    # (parser, output, reasoning, content)
    ("qwen3", "<think>\nplan a, then b\n</think>\n\nThe answer.", "\nplan a, then b\n", "\n\nThe answer."),
    ("qwen3", "No thinking here.", "", "No thinking here."),
    ("qwen3", "<think>still thinking", "still thinking", ""),
    ("qwen3", "<think></think>", "", ""),
    ("qwen3", "a < b and </thin", "", "a < b and </thin"),
    ("deepseek_r1", "weigh it up</think>Yes.", "weigh it up", "Yes."),
    ("deepseek_r1", "<think>weigh</think>No.", "weigh", "No."),
    ("deepseek_r1", "never closed </thin", "never closed </thin", ""),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_split_whole(parser, text, reasoning, content):
    assert split(parser, text, final=True) == (reasoning, content)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_streamed_in_pieces_of_any_size_adds_up_to_the_whole(parser, text, reasoning, content):
    for size in range(1, len(text) + 1):
        stream, got_reasoning, got_content = ReasoningStream(parser), "", ""
        for end in range(size, len(text) + size, size):
            piece_r, piece_c = stream.feed(text[:end], final=end >= len(text))
            assert "</think>"[:2] not in piece_c or "</think>" not in text  # no tag leaks into content
            got_reasoning += piece_r
            got_content += piece_c
        assert (got_reasoning, got_content) == (reasoning, content), size


def test_a_tag_cut_by_a_chunk_is_held_back_until_whole():
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("abc</th", final=False) == ("abc", "")
    assert stream.feed("abc</think>x", final=False) == ("", "x")


QWEN3 = (
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
R1 = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\\n{% endif %}"


@pytest.mark.parametrize(
    "template,parser", [(QWEN3, "qwen3"), (R1, "deepseek_r1"), ("{{ messages[0].content }}", None), (None, None)]
)
def test_auto_reads_the_chat_template(template, parser):
    assert parser_for_template(template) == parser


def test_reasoning_content_over_a_socket_whole_and_streamed(start_server):
    live = start_server(app_kwargs={"reasoning_parser": "qwen3"})
    client = live.client()
    # A fixed shape from the tiny model; thinking off, so the grammar covers the whole output (with
    # thinking on it would start after </think>, which the random model never writes).
    forced = {"guided_regex": "<think>[a-c]{3}</think>[a-c]{3}", "chat_template_kwargs": {"enable_thinking": False}}
    message = (
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=40,
            temperature=0,
            extra_body=forced,
        )
        .choices[0]
        .message
    )
    assert len(message.reasoning_content) == 3 and len(message.content) == 3
    assert "<think>" not in message.content
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=40,
        temperature=0,
        extra_body=forced,
        stream=True,
    ):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)
    live.wait_idle()


def test_without_a_parser_everything_is_content(live):
    message = (
        live.client()
        .chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=40,
            temperature=0,
            extra_body={"guided_regex": "<think>[a-c]{3}</think>[a-c]{3}"},
        )
        .choices[0]
        .message
    )
    assert message.content.startswith("<think>") and getattr(message, "reasoning_content", None) is None


def test_structured_output_starts_after_the_thinking(start_server):
    """With a reasoning parser, response_format holds the answer only: qwen3 may answer at once
    (valid JSON, no reasoning); deepseek_r1's prompt opened <think>, so the output thinks first,
    in free text the schema does not touch (the random model never closes it: all reasoning)."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], temperature=0, response_format=fmt)
    qwen3 = start_server(app_kwargs={"reasoning_parser": "qwen3"}).client()
    message = qwen3.chat.completions.create(**ask, max_tokens=40).choices[0].message
    assert json.loads(message.content)["n"] in range(10) and message.reasoning_content is None
    r1 = start_server(app_kwargs={"reasoning_parser": "deepseek_r1"}).client()
    choice = r1.chat.completions.create(**ask, max_tokens=12).choices[0]
    assert choice.finish_reason == "length" and choice.message.reasoning_content and not choice.message.content
    off = (
        r1.chat.completions.create(
            **ask, max_tokens=40, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        .choices[0]
        .message
    )  # thinking off: JSON at once
    assert json.loads(off.reasoning_content or off.content)["n"] in range(10)
