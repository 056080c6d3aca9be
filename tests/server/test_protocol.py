"""Request parsing and the request -> SamplingParams mapping, without a server: nothing remapped, nothing dropped."""

from __future__ import annotations

import json

import pytest

from server.errors import APIError
from server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from server.serving_common import make_choices, sampling_params


def parse(cls, **body):
    return parse_body(json.dumps(body).encode(), cls)


def test_every_sampling_field_maps_to_its_own_parameter():
    body = parse(
        CompletionRequest,
        model="m",
        prompt="hi",
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.3,
        seed=11,
        stop=["a", "bc"],
        stop_token_ids=[3],
        ignore_eos=True,
        min_tokens=2,
        logit_bias={"7": -100, "9": 2.5},
        n=2,
    )
    params = sampling_params(body, max_tokens=9, logprobs=3)
    assert [p.seed for p in params] == [11, 12]  # n samples differ, reproducibly
    p = params[0]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (9, 0.7, 0.9, 5, 0.1)
    # presence/frequency penalties stay OpenAI's additive penalties; repetition_penalty is separate.
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.3)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens, p.logprobs) == (("a", "bc"), (3,), True, 2, 3)
    assert p.logit_bias == {7: -100.0, 9: 2.5}


def test_openai_defaults_when_fields_are_absent_or_null():
    body = parse(CompletionRequest, model="m", prompt="hi", temperature=None, top_p=None, n=None, stop=None)
    (p,) = sampling_params(body, max_tokens=16, logprobs=None)
    assert (p.temperature, p.top_p, p.top_k, p.presence_penalty, p.repetition_penalty, p.seed) == (
        1.0,
        1.0,
        0,
        0.0,
        1.0,
        None,
    )
    assert p.stop == () and p.logit_bias == {} and p.logprobs is None


def test_off_values_of_unsupported_fields_are_dropped_and_others_refused():
    body = parse(
        ChatCompletionRequest,
        model="m",
        messages=[{"role": "user", "content": "x"}],
        tools=[],
        response_format={"type": "text"},
        store=False,
    )
    assert body.template_messages() == [{"role": "user", "content": "x"}]
    with pytest.raises(APIError) as exc:
        parse(ChatCompletionRequest, model="m", messages=[{"role": "user", "content": "x"}], store=True)
    assert exc.value.status == 400 and exc.value.param == "store" and "not supported" in exc.value.message


def test_text_parts_join_and_roles_pass_through():
    body = parse(
        ChatCompletionRequest,
        model="m",
        messages=[
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
    )
    assert body.template_messages() == [{"role": "developer", "content": "rules"}, {"role": "user", "content": "a\nb"}]


@pytest.mark.parametrize(
    "prompt,expected", [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])]
)
def test_prompt_shapes(prompt, expected):
    assert parse(CompletionRequest, model="m", prompt=prompt).prompts(vocab_size=10) == expected


def test_choices_are_numbered_prompt_major():
    body = parse(CompletionRequest, model="m", prompt="hi", n=2)
    choices = make_choices("cmpl-x", [[1], [2]], sampling_params(body, max_tokens=4, logprobs=None))
    assert [(c.index, c.request_id, c.prompt_token_ids) for c in choices] == [
        (0, "cmpl-x-0", [1]),
        (1, "cmpl-x-1", [1]),
        (2, "cmpl-x-2", [2]),
        (3, "cmpl-x-3", [2]),
    ]
