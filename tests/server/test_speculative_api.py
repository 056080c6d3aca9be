"""Speculative decoding over HTTP: two servers on the real SmolLM2 GGUF, one with n-gram drafts
and one without, answer the same requests with the same text and logprobs; streams send each
accepted run as one delta and concatenate to the whole text; vLLM's counters count drafts."""

from __future__ import annotations

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.speculative import SpeculativeConfig
from models.layers import cpu_kernels
from server.app import create_app
from tests.server.conftest import LiveServer

QUOTE = (
    "We hold these truths to be self-evident, that all men are created equal, that they are endowed "
    "by their Creator with certain unalienable Rights, that among these are Life, Liberty and the "
    "pursuit of Happiness."
)
MESSAGES = [{"role": "user", "content": f"Repeat this sentence word for word: {QUOTE}"}]


@pytest.fixture(scope="module")
def servers():
    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable: the eager paths are not row-invariant")
    from models.fetch import default_model_path
    from models.loader import load_model

    loaded = load_model(str(default_model_path()))
    started = []
    for spec in (None, SpeculativeConfig(num_speculative_tokens=4)):
        engine = AsyncEngine(loaded, EngineConfig(num_kv_blocks=128, max_num_seqs=8, speculative=spec))
        started.append(LiveServer(create_app(engine, served_model_name="smollm2"), engine).start())
    yield started
    for live in started:
        live.stop()


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=123)])
def test_chat_answers_are_the_same_with_drafts_and_streams_concatenate(servers, sampling):
    plain, spec = servers
    answers = []
    for live in (plain, spec):
        reply = live.client().chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=48, logprobs=True, top_logprobs=2, **sampling
        )
        answers.append(reply)
    a, b = (r.choices[0] for r in answers)
    assert a.message.content == b.message.content and a.finish_reason == b.finish_reason
    assert [(t.token, t.logprob) for t in a.logprobs.content] == [(t.token, t.logprob) for t in b.logprobs.content]
    assert answers[0].usage.completion_tokens == answers[1].usage.completion_tokens

    stream = spec.client().chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        max_tokens=48,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
        **sampling,
    )
    deltas, logprobs, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            if choice.logprobs is not None:
                logprobs += choice.logprobs.content
    assert "".join(deltas) == b.message.content
    assert len(logprobs) == usage.completion_tokens == answers[1].usage.completion_tokens
    assert [t.logprob for t in logprobs] == [t.logprob for t in b.logprobs.content]


def test_completions_with_a_stop_string_inside_a_run(servers):
    plain, spec = servers
    prompt = f"{QUOTE}\n{QUOTE[:40]}"
    texts = [
        live.client()
        .completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0, stop=["Creator"])
        .choices[0]
        for live in (plain, spec)
    ]
    assert texts[0].text == texts[1].text and "Creator" not in texts[1].text
    assert texts[1].finish_reason == "stop"


def test_metrics_count_drafts_with_vllms_names(servers):
    _, spec = servers
    spec.client().completions.create(model="smollm2", prompt=f"{QUOTE}\n{QUOTE[:30]}", max_tokens=24, temperature=0)
    labels = 'model_name="smollm2"'
    drafts = spec.metric("vllm:spec_decode_num_draft_tokens_total", labels)
    accepted = spec.metric("vllm:spec_decode_num_accepted_tokens_total", labels)
    assert spec.metric("vllm:spec_decode_num_drafts_total", labels) > 0
    assert drafts >= accepted > 0
    assert spec.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", labels + ',position="0"') > 0
    spec.wait_idle()
