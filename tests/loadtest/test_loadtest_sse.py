"""SSE decoding and OpenAI stream validation: every violation is counted by kind."""

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtest.sse import SSEDecoder, StreamValidator


def chunk(text=None, id="cmpl-1", usage=None, finish=None, obj="text_completion", choices=None):
    if choices is None:
        choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
    body = {"id": id, "object": obj, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
GOOD = chunk(" a") + chunk(" b") + chunk(" c", finish="length") + chunk(usage=USAGE) + "data: [DONE]\n\n"


def validate(stream: str, endpoint: str = "completions", piece: int | None = None) -> StreamValidator:
    """Feed `stream` (in pieces of `piece` characters, default all at once) and finish it."""
    decoder, validator = SSEDecoder(), StreamValidator(endpoint)
    step = piece or len(stream) or 1
    for i in range(0, len(stream), step):
        for event in decoder.feed(stream[i : i + step], now=float(i)):
            validator.on_event(event)
    decoder.close()
    validator.finish()
    validator.violations[:0] = decoder.violations
    return validator


def test_good_stream_has_no_violations_and_three_content_chunks():
    v = validate(GOOD)
    assert v.violations == []
    assert len(v.content_times) == 3
    assert v.usage == USAGE
    assert v.done and v.stream_id == "cmpl-1" and v.finish_reason == "length"


@pytest.mark.parametrize("piece", [1, 2, 7])
def test_stream_split_anywhere_decodes_the_same(piece):
    v = validate(GOOD, piece=piece)
    assert v.violations == [] and len(v.content_times) == 3


@given(st.lists(st.integers(min_value=0, max_value=len(GOOD)), max_size=20))
def test_stream_split_at_arbitrary_points_decodes_the_same(cuts):
    decoder, validator = SSEDecoder(), StreamValidator("completions")
    bounds = [0, *sorted(cuts), len(GOOD)]
    for start, end in itertools.pairwise(bounds):  # empty pieces too
        for event in decoder.feed(GOOD[start:end], now=0.0):
            validator.on_event(event)
    decoder.close()
    validator.finish()
    assert decoder.violations == [] and validator.violations == []
    assert len(validator.content_times) == 3


def test_crlf_line_endings_and_keepalive_comments_are_valid():
    stream = ": ping\r\n\r\n" + GOOD.replace("\n", "\r\n")
    v = validate(stream, piece=1)  # a '\r' at a piece boundary must not end a line twice
    assert v.violations == [] and len(v.content_times) == 3


def test_chat_role_only_chunk_is_not_content():
    role = {"index": 0, "delta": {"role": "assistant"}}
    tok = {"index": 0, "delta": {"content": "hi"}}
    stream = (
        chunk(obj="chat.completion.chunk", choices=[role])
        + chunk(obj="chat.completion.chunk", choices=[tok])
        + chunk(obj="chat.completion.chunk", choices=[], usage={"prompt_tokens": 2, "completion_tokens": 1})
        + "data: [DONE]\n\n"
    )
    v = validate(stream, endpoint="chat")
    assert v.violations == [] and len(v.content_times) == 1


def test_content_chunk_time_is_when_its_event_completed():
    decoder, validator = SSEDecoder(), StreamValidator("completions")
    first = chunk(" a")
    for event in decoder.feed(first[:-1], now=1.0):  # blank line not here yet
        validator.on_event(event)
    assert validator.content_times == []
    for event in decoder.feed(first[-1:], now=2.0):
        validator.on_event(event)
    assert validator.content_times == [2.0]


@pytest.mark.parametrize(
    "stream, kind",
    [
        (GOOD.replace("data: [DONE]\n\n", ""), "missing_done"),
        (chunk(" a") + "data: {not json\n\n" + chunk(usage=USAGE) + "data: [DONE]\n\n", "invalid_json"),
        (chunk(" a") + chunk(" b", id="cmpl-2") + chunk(usage=USAGE) + "data: [DONE]\n\n", "inconsistent_id"),
        (chunk(" a") + "data: [DONE]\n\n", "missing_usage"),
        (GOOD + chunk(" late"), "data_after_done"),
        (GOOD.replace("\n\n", "\n", 1), "sse_framing"),  # two chunks in one event
        ('{"id": "cmpl-1", "choices": []}\n\n' + GOOD, "sse_framing"),  # JSON without `data:`
        (GOOD[:-2], "sse_framing"),  # stream cut before the final blank line
        (chunk(" a") + 'data: {"error": {"message": "boom"}}\n\n', "server_error"),
        (chunk(" a", obj="chat.completion.chunk") + chunk(usage=USAGE) + "data: [DONE]\n\n", "bad_chunk"),
        (chunk(usage={"prompt_tokens": 1}) + "data: [DONE]\n\n", "bad_usage"),
        (
            chunk(" a") + chunk(" b") + chunk(usage={"prompt_tokens": 1, "completion_tokens": 1}) + "data: [DONE]\n\n",
            "bad_usage",
        ),  # fewer tokens than content chunks
        (chunk(usage=USAGE) + "data: [DONE]\n\n", "no_content"),
    ],
)
def test_protocol_violation_is_counted_by_kind(stream, kind):
    v = validate(stream)
    assert kind in v.violations


def test_cut_stream_reports_framing_then_missing_done():
    v = validate(GOOD[:-2])  # "data: [DONE]" never terminated: the event is never dispatched
    assert v.violations == ["sse_framing", "missing_done"]


def test_server_error_message_is_kept():
    v = validate('data: {"error": {"message": "out of KV blocks"}}\n\n')
    assert v.error_message == "out of KV blocks"
