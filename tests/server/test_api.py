"""The API through the official openai client against a live server on a tiny float32 model."""

from __future__ import annotations

import re

import pytest

from tests.server.conftest import MODEL_NAME

M = MODEL_NAME
PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


def test_models_health_and_tokenizer_endpoints(live):
    assert live.http.get("/health").status_code == 200
    models = live.client().models.list()
    assert [m.id for m in models.data] == [M]
    tokens = live.http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 128
    assert live.http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}
    chat = live.http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert live.http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_model_alias_is_listed_after_the_name_and_answers_under_the_name(start_server):
    server = start_server(app_kwargs={"served_model_aliases": (f"{M}.Q4_1",)})
    assert [m.id for m in server.client().models.list().data] == [M, f"{M}.Q4_1"]
    assert server.http.get(f"/v1/models/{M}.Q4_1").json()["id"] == f"{M}.Q4_1"
    result = server.client().completions.create(model=f"{M}.Q4_1", prompt=PROMPT, max_tokens=2, temperature=0)
    assert result.model == M
    chat = server.http.post("/v1/chat/completions", json={"model": f"{M}.Q4_1", "messages": MESSAGES, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == M
    assert server.http.post("/v1/completions", json={"model": f"{M}.Q8_0", "prompt": PROMPT}).status_code == 404
    assert server.http.get(f"/v1/models/{M}.Q8_0").status_code == 404


def test_completion_has_usage_and_timing_headers(live):
    raw = live.client().completions.with_raw_response.create(model=M, prompt=PROMPT, max_tokens=7, temperature=0)
    result = raw.parse()
    choice = result.choices[0]
    assert result.object == "text_completion" and result.model == M and result.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    num_prompt = live.http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (num_prompt, 7)
    assert result.usage.total_tokens == num_prompt + 7
    assert result.usage.prompt_tokens_details.cached_tokens >= 0
    timing = raw.headers["server-timing"]
    assert re.fullmatch(r"queue;dur=[\d.]+, prefill;dur=[\d.]+, decode;dur=[\d.]+", timing), timing
    assert float(raw.headers["x-prefill-ms"]) > 0 and float(raw.headers["x-decode-ms"]) > 0


def test_repeated_prompt_reports_cached_tokens(live):
    prompt = "Paged attention serves many requests from one pool of key/value blocks. " * 2
    client = live.client()
    client.completions.create(model=M, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=M, prompt=prompt, max_tokens=1)
    # Block size 8: every full block of the prompt but the last token's comes from the cache.
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 8 > 0


def test_cache_salt_shares_the_prefix_cache_only_within_a_salt(live):
    """vLLM's `cache_salt`: a salted request hits only blocks cached under the same salt, and an
    unsalted one none of a salted one's; a salt outside its bounds is a 400."""
    prompt = "Every tenant gets its own prefix cache when its requests carry a salt. " * 2
    client = live.client()

    def cached(**extra) -> int:
        reply = client.completions.create(model=M, prompt=prompt, max_tokens=1, extra_body=extra or None)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0  # first sight of this prompt
    assert cached(cache_salt="tenant-b") == 0  # a's blocks are not b's
    assert cached() == 0  # nor an unsalted request's
    assert cached(cache_salt="tenant-a") > 0 and cached() > 0  # each finds its own
    chat = client.chat.completions.create(
        model=M, messages=[{"role": "user", "content": prompt}], max_tokens=1, extra_body={"cache_salt": "tenant-c"}
    )
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    for hits in (False, True):  # the Responses API takes it too
        response = client.responses.create(
            model=M, input=prompt, max_output_tokens=1, extra_body={"cache_salt": "tenant-d"}
        )
        assert (response.usage.input_tokens_details.cached_tokens > 0) == hits
    for salt in ("", "x" * 257):
        response = live.http.post(
            "/v1/completions", json={"model": M, "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_text_concatenates_to_the_non_streamed_text(live, kind):
    client = live.client()
    common = dict(model=M, max_tokens=24, temperature=0)
    if kind == "completion":
        whole = client.completions.create(prompt=PROMPT, **common)
        chunks = list(
            client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **common)
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = whole.choices[0].text
    else:
        whole = client.chat.completions.create(messages=MESSAGES, **common)
        chunks = list(
            client.chat.completions.create(
                messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **common
            )
        )
        first = chunks[0].choices[0]
        assert first.delta.role == "assistant" and first.delta.content == ""
        assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = whole.choices[0].message.content
    assert text == expected and text
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].id != whole.id
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert set(usage_chunk.usage.model_extra["timings"]) == {"queue_ms", "prefill_ms", "decode_ms"}
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_and_seed_reproduce(live):
    client = live.client()
    kwargs = dict(model=M, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=1234)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1, "n samples with one seed must still differ"
    if all(c.finish_reason == "length" for c in first.choices):
        assert first.usage.completion_tokens == 3 * 12
    chat = client.chat.completions.create(model=M, messages=MESSAGES, max_tokens=5, n=2, seed=7)
    assert [c.index for c in chat.choices] == [0, 1]


def test_several_prompts_times_n_are_numbered_prompt_major(live):
    client = live.client()
    result = client.completions.create(model=M, prompt=["Hello", PROMPT], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    single = [
        client.completions.create(model=M, prompt=p, max_tokens=4, temperature=0).choices[0].text
        for p in ("Hello", PROMPT)
    ]
    assert [c.text for c in result.choices] == [single[0], single[0], single[1], single[1]]
    counts = [live.http.post("/tokenize", json={"prompt": p}).json()["count"] for p in ("Hello", PROMPT)]
    assert result.usage.prompt_tokens == sum(counts)  # each prompt once, not n times


def test_token_id_prompt_and_echo(live):
    client = live.client()
    ids = live.http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=M, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    by_ids = client.completions.create(model=M, prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert by_ids == by_text
    echoed = client.completions.create(model=M, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + by_text
    streamed = client.completions.create(model=M, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + by_text


def test_stop_string_ends_the_text_before_it(live):
    client = live.client()
    full = client.completions.create(model=M, prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    match = re.search(r"[!-~]{2}", full[2:])  # two printable ASCII characters, not at the very start
    assert match, f"tiny model produced no ASCII pair in {full!r}"
    stop = match.group(0)
    cut = full[: full.index(stop)]
    result = client.completions.create(model=M, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop, "\x00zz"])
    assert (result.choices[0].text, result.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model=M, prompt=PROMPT, max_tokens=32, temperature=0, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(live):
    result = live.client().completions.create(model=M, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the sampled token is the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_carry_exact_bytes(live):
    result = live.client().chat.completions.create(
        model=M, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens == 10
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    raw = b"".join(bytes(entry.bytes) for entry in content)
    assert raw.decode("utf-8", errors="replace") == result.choices[0].message.content
    no_lp = live.client().chat.completions.create(model=M, messages=MESSAGES, max_tokens=2)
    assert no_lp.choices[0].logprobs is None


def test_logit_bias_is_honoured(live):
    client = live.client()
    token = live.http.post("/tokenize", json={"prompt": " fox"}).json()["tokens"][-1]
    forced = client.completions.create(
        model=M, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(token): 100}, logprobs=0
    )
    assert (
        forced.choices[0].logprobs.tokens
        == [live.http.post("/detokenize", json={"tokens": [token]}).json()["prompt"]] * 5
    )
    greedy = client.completions.create(model=M, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    first = live.http.post("/tokenize", json={"prompt": greedy.choices[0].text}).json()["tokens"][0]
    banned = client.completions.create(
        model=M, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != greedy.choices[0].text


def test_chat_max_completion_tokens_and_default_length(live):
    client = live.client()
    result = client.chat.completions.create(model=M, messages=MESSAGES, max_completion_tokens=3, temperature=0)
    assert result.usage.completion_tokens == 3 and result.choices[0].finish_reason == "length"
    # No limit given: generation may run to the end of the 128-token context.
    open_ended = client.chat.completions.create(
        model=M, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert open_ended.usage.prompt_tokens + open_ended.usage.completion_tokens == 128
    assert open_ended.choices[0].finish_reason == "length"


def test_metrics_count_requests_tokens_and_latencies(live):
    before = live.metric("pagedserve:request_success_total", 'finish_reason="length"')
    tokens_before = live.metric("pagedserve:generation_tokens_total")
    live.client().completions.create(model=M, prompt=PROMPT, max_tokens=5, n=2)
    assert live.metric("pagedserve:request_success_total", 'finish_reason="length"') >= before + 1
    assert live.metric("pagedserve:generation_tokens_total") >= tokens_before + 5
    text = live.http.get("/metrics").text
    for name in (
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "prompt_tokens_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_blocks_used",
        "prefix_cache_hit_rate",
        "num_preemptions_total",
        "model_weight_bytes",
        "kv_cache_bytes",
        "num_stalled_aborts_total",
    ):
        assert re.search(rf"^pagedserve:{name} [\d.e+-]+$", text, re.M), name
    assert live.metric("pagedserve:model_weight_bytes") > 0 and live.metric("pagedserve:kv_cache_bytes") > 0
    assert live.metric("pagedserve:time_to_first_token_seconds_count") > 0
    assert live.metric("pagedserve:inter_token_latency_seconds_count") > 0
    # CPU: the steps by the thread count they ran with, counted as the engine ran them
    steps = {
        int(m[1]): float(m[2])
        for m in re.finditer(r'^pagedserve:engine_steps_total\{num_threads="(\d+)"\} (\S+)$', text, re.M)
    }
    assert steps and all(threads >= 1 for threads in steps), text
    live.wait_idle()
    stats = live.engine.stats()
    # every step that ran the model, once (num_steps also counts steps with nothing scheduled or that failed)
    assert 0 < sum(steps.values()) <= stats.num_steps - stats.num_failed_steps
    tokens = sum(live.metric("pagedserve:engine_step_tokens_total", f'num_threads="{t}"') for t in steps)
    assert tokens == stats.num_computed_tokens
    assert all(live.metric("pagedserve:engine_step_seconds_total", f'num_threads="{t}"') > 0 for t in steps)


def test_openapi_documents_each_request_model_with_its_bounds(live):
    document = live.http.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    for path, name in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/tokenize", "TokenizeRequest"),
        ("/detokenize", "DetokenizeRequest"),
    ]:
        body = document["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert schemas[name]["additionalProperties"] is False
    completion = schemas["CompletionRequest"]
    assert set(completion["required"]) == {"model", "prompt"}
    top_p = completion["properties"]["top_p"]["anyOf"][0]
    assert top_p["minimum"] == 1e-8 and top_p["maximum"] == 1
    assert completion["properties"]["repetition_penalty"]["anyOf"][0] == {
        "type": "number",
        "minimum": 0.01,
        "maximum": 2.0,
    }
    assert {
        "type": "array",
        "items": {"type": "string", "minLength": 1, "maxLength": 1024},
        "maxItems": 4,
    } in completion["properties"]["stop"]["anyOf"]
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert live.http.get("/docs").status_code == 200
