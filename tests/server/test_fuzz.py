"""Hostile bodies against a live server: never a 5xx, an OpenAI error body on every 4xx, and the
server serves a normal request afterwards; a neighbour stream keeps flowing meanwhile."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME
from tests.server.test_hostile import HUGE, slow_down

M = MODEL_NAME
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Text that tokenizers, templates and parsers trip on: surrogates, NULs, RTL, huge code points.
hostile_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\ud800", "\udfff", "\x00", "\u202e", "\U0010ffff", "{{ raise }}", "<|im_start|>", "ÿ" * 50, ""]),
)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63, -(2**63) - 1, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-300, 5e-324, -0.0, 1e308]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, hostile_text)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(hostile_text, inner, max_size=4)),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer"]), json_values),
        "content": st.one_of(
            hostile_text,
            st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": hostile_text}),
                max_size=2,
            ),
            json_values,
        ),
        "name": json_values,
    },
)
SAMPLING = {
    "n": st.one_of(st.integers(-2, 3), json_values),
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "min_p": numbers,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "logit_bias": st.one_of(
        st.dictionaries(
            st.one_of(st.sampled_from(["²", "١٢", "5" * 50, "-1", "299", "300"]), hostile_text), numbers, max_size=3
        ),
        json_values,
    ),
    "seed": numbers,
    "stop": st.one_of(hostile_text, st.lists(hostile_text, max_size=6), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": json_values,
    "stop_token_ids": st.one_of(st.lists(numbers, max_size=3), json_values),
    "ignore_eos": json_values,
    "min_tokens": numbers,
    "max_tokens": st.one_of(st.integers(-1, 8), numbers),
}
model = st.one_of(st.just(M), st.just(M), st.just(M), json_values)  # mostly right, so the rest is reached
completion_bodies = st.fixed_dictionaries(
    {"model": model},
    optional={
        **SAMPLING,
        "prompt": st.one_of(
            hostile_text,
            st.lists(st.one_of(st.integers(-5, 400), hostile_text), max_size=4),
            st.lists(st.lists(numbers, max_size=3), max_size=2),
            json_values,
        ),
        "echo": json_values,
        "logprobs": numbers,
        "best_of": numbers,
        "suffix": json_values,
        "foo": json_values,
    },
)
chat_bodies = st.fixed_dictionaries(
    {"model": model},
    optional={
        **SAMPLING,
        "messages": st.one_of(st.lists(message, max_size=3), json_values),
        "logprobs": json_values,
        "top_logprobs": numbers,
        "max_completion_tokens": numbers,
        "tools": json_values,
        "response_format": json_values,
    },
)
tokenize_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just(M), json_values),
        "prompt": st.one_of(hostile_text, json_values),
        "messages": st.one_of(st.lists(message, max_size=3), json_values),
        "add_special_tokens": json_values,
        "add_generation_prompt": json_values,
    },
)
# A body need not be an object at all.
anything = st.one_of(json_values, st.binary(max_size=30).map(lambda b: ("raw", b)))


def send(live, path: str, body) -> httpx.Response:
    if isinstance(body, tuple):  # ("raw", bytes): not even JSON
        content = body[1]
    else:
        content = json.dumps(body, ensure_ascii=True).encode()  # surrogates travel as \\ud800 escapes
    return live.http.post(path, content=content, headers={"content-type": "application/json"})


def assert_sound(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and "param" in error and "code" in error
    elif response.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in response.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]"
        assert not any('"error"' in line and '"server_error"' in line for line in lines), lines


def assert_still_serves(live) -> None:
    response = live.http.post("/v1/completions", json={"model": M, "prompt": "Hello", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    live.wait_idle()


@pytest.mark.parametrize(
    "path,bodies",
    [("/v1/completions", completion_bodies), ("/v1/chat/completions", chat_bodies), ("/tokenize", tokenize_bodies)],
)
def test_hostile_bodies_never_get_a_5xx_and_4xx_are_openai_errors(live, path, bodies):
    @FUZZ
    @given(body=st.one_of(bodies, bodies, anything))
    def case(body):
        assert_sound(send(live, path, body))

    case()
    assert_still_serves(live)


def test_a_neighbour_stream_keeps_flowing_while_huge_and_hostile_requests_arrive(start_server):
    live = start_server()
    slow_down(live.engine, 0.05)  # 100 tokens: ~5 s, long enough to overlap the attacks
    arrivals: list[float] = []
    lines: list[str] = []
    started = threading.Event()

    def neighbour() -> None:
        body = {"model": M, "prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    arrivals.append(time.monotonic())
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=neighbour)
    reader.start()
    assert started.wait(30)
    deep = b'{"model": "%s", "prompt": ' % M.encode() + b"[" * 5000 + b"]" * 5000 + b"}"
    attacks = [
        ("/v1/completions", json.dumps({"model": M, "prompt": HUGE, "max_tokens": 1}).encode()),
        ("/tokenize", json.dumps({"prompt": HUGE}).encode()),
        ("/v1/chat/completions", json.dumps({"model": M, "messages": [{"role": "user", "content": HUGE}]}).encode()),
        ("/v1/completions", deep),
        ("/v1/completions", b'{"model": "%s", "prompt": "hi", "seed": %s}' % (M.encode(), b"9" * 5000)),
        (
            "/v1/completions",
            json.dumps({"model": M, "prompt": "hi", "stop": ["x" * 1024] * 4, "max_tokens": 4}).encode(),
        ),
    ]
    with httpx.Client(base_url=live.url, timeout=60) as client:
        for path, content in attacks:
            response = client.post(path, content=content, headers={"content-type": "application/json"})
            assert_sound(response)
    attacks_done = time.monotonic()
    reader.join(60)
    assert arrivals[-1] > attacks_done, "the attacks did not overlap the stream"
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    assert '"finish_reason":"length"' in lines[-2]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert max(gaps) < 1.0, f"the neighbour stream stalled for {max(gaps):.2f}s"


# schemathesis against the app's own /openapi.json: requests built from the published request
# models, valid and invalid ones, a few examples per operation so the file stays within a minute.
schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402


@pytest.mark.timeout(90)
def test_schemathesis_requests_from_the_openapi_document(live):
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    strategies = [
        op.as_strategy(generation_mode=mode)
        for op in operations
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    ]
    deadline = time.monotonic() + 40  # a time bound as well as an example bound
    statuses: list[int] = []

    @settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(strategies))
    def case(case):
        if time.monotonic() > deadline:
            return
        response = case.call(timeout=30)
        case.validate_response(response, checks=[not_a_server_error])
        statuses.append(response.status_code)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and isinstance(error["type"], str), response.text

    case()
    assert len(statuses) >= 20 and 200 in statuses and 400 in statuses, statuses
    assert_still_serves(live)
