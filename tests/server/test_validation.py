"""Every kind of bad input gets its status and an OpenAI error body, never a 500, and never reaches the engine."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL_NAME

M = MODEL_NAME
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (path, JSON body, expected status, expected param (None: no param), text the message must contain)
BAD_REQUESTS = [
    # unknown, unsupported and missing fields
    (CMPL, {"model": M, "prompt": "hi", "foo": 1}, 400, "foo", "Unrecognized request argument"),
    (CHAT, {"model": M, "messages": USER, "functions": [{"name": "f"}]}, 400, "functions", "not supported"),
    # structured output and tools
    (
        CHAT,
        {"model": M, "messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "response_format.json_schema",
        "is required",
    ),
    (
        CHAT,
        {
            "model": M,
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}},
        },
        400,
        "response_format",
        "wat",
    ),
    (CMPL, {"model": M, "prompt": "hi", "guided_regex": "a(b"}, 400, "guided_regex", "regex"),
    (CMPL, {"model": M, "prompt": "hi", "guided_json": "{not json"}, 400, "guided_json", "not valid JSON"),
    (CMPL, {"model": M, "prompt": "hi", "guided_grammar": "start: nothing_defined"}, 400, "guided_grammar", "grammar"),
    (CMPL, {"model": M, "prompt": "hi", "guided_choice": []}, 400, "guided_choice", "at least 1"),
    (
        CMPL,
        {"model": M, "prompt": "hi", "guided_regex": "a", "structured_outputs": {"choice": ["a"]}},
        400,
        "structured_outputs.choice",
        "Only one",
    ),
    (CHAT, {"model": M, "messages": USER, "tool_choice": "required"}, 400, "tool_choice", "needs 'tools'"),
    (
        CHAT,
        {
            "model": M,
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
        "not in 'tools'",
    ),
    (
        CHAT,
        {"model": M, "messages": USER, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
        400,
        "tools[0].function.name",
        "pattern",
    ),
    (CHAT, {"model": M, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id", "required"),
    (CHAT, {"model": M, "messages": [{"role": "user", "content": None}]}, 400, "messages[0].content", "required"),
    (CMPL, {"model": M, "prompt": "hi", "best_of": 2}, 400, "best_of", "not supported"),
    # fields routers add (vllm-router, SGLang's router): values we do not honour are refused
    (CMPL, {"model": M, "prompt": "hi", "no_stop_trim": True}, 400, "no_stop_trim", "not supported"),
    (CHAT, {"model": M, "messages": USER, "return_hidden_states": True}, 400, "return_hidden_states", "not supported"),
    (
        CHAT,
        {"model": M, "messages": USER, "continue_final_message": True},
        400,
        "continue_final_message",
        "not supported",
    ),
    (
        CMPL,
        {"model": M, "prompt": "hi", "max_tokens": 3, "max_completion_tokens": 4},
        400,
        "max_completion_tokens",
        "differ",
    ),
    (CMPL, {"model": M, "prompt": "hi", "skip_special_tokens": "no"}, 400, "skip_special_tokens", "boolean"),
    # chat_template_kwargs: a few named scalars, not what the server passes the template itself
    (
        CHAT,
        {"model": M, "messages": USER, "chat_template_kwargs": {f"v{i}": 1 for i in range(17)}},
        400,
        "chat_template_kwargs",
        "at most 16",
    ),
    (
        CHAT,
        {"model": M, "messages": USER, "chat_template_kwargs": {"tools": []}},
        400,
        "chat_template_kwargs.tools",
        "keys must be",
    ),
    (
        CHAT,
        {"model": M, "messages": USER, "chat_template_kwargs": {"enable_thinking": {"a": 1}}},
        400,
        "chat_template_kwargs.enable_thinking",
        "values must be",
    ),
    # OpenAI's metadata bounds: 16 pairs, keys of 64 characters, string values of 512
    (CHAT, {"model": M, "messages": USER, "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata", "16 pairs"),
    (CMPL, {"model": M, "prompt": "hi", "metadata": {"k": "v" * 513}}, 400, "metadata.k", "512"),
    (CMPL, {"model": M, "prompt": "hi", "metadata": {"k": 1}}, 400, "metadata.k", "string"),
    (CMPL, {"model": M, "prompt": "hi", "suffix": "x"}, 400, "suffix", "not supported"),
    # prompt logprobs: vLLM's bound (20), not streamed
    (CMPL, {"model": M, "prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs", "less than or equal to 20"),
    (CHAT, {"model": M, "messages": USER, "prompt_logprobs": -1}, 400, "prompt_logprobs", "greater than or equal to 0"),
    (CHAT, {"model": M, "messages": USER, "prompt_logprobs": "1"}, 400, "prompt_logprobs", "integer"),
    (
        CMPL,
        {"model": M, "prompt": "hi", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
        "not available when 'stream'",
    ),
    (CMPL, {"model": M, "prompt": "hi", "echo": True, "logprobs": 6}, 400, "logprobs", "less than or equal to 5"),
    (
        CHAT,
        {"model": M, "messages": [{"role": "function", "content": "x", "name": "f"}]},
        400,
        "messages[0].role",
        "not supported",
    ),
    (
        CHAT,
        {
            "model": M,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        },
        400,
        "messages[0].content[0].type",
        "not supported",
    ),
    (
        CHAT,
        {"model": M, "messages": [{"role": "user", "content": "hi", "name": "bob"}]},
        400,
        "messages[0].name",
        "not supported",
    ),
    (CMPL, {"prompt": "hi"}, 400, "model", "Missing required parameter"),
    (CHAT, {"model": M}, 400, "messages", "Missing required parameter"),
    # bad types (no coercion: OpenAI rejects "5" for an integer)
    (CMPL, {"model": M, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "expected an integer, but got a string"),
    (CMPL, {"model": M, "prompt": "hi", "n": True}, 400, "n", "integer"),
    (CMPL, {"model": M, "prompt": "hi", "temperature": "hot"}, 400, "temperature", "expected a number"),
    (CMPL, {"model": M, "prompt": 5}, 400, "prompt", "must be a string"),
    (CMPL, {"model": M, "prompt": ["a", 1]}, 400, "prompt", "must be a string"),
    (CMPL, {"model": M, "prompt": "hi", "seed": "x"}, 400, "seed", "integer"),
    (CHAT, {"model": M, "messages": "hi"}, 400, "messages", "expected an array, but got a string"),
    (CHAT, {"model": M, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "Input should be"),
    # values out of range
    (CMPL, {"model": M, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 0"),
    (CMPL, {"model": M, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "at least 1 unless 'echo'"),
    (CMPL, {"model": M, "prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens", "too large"),
    (CHAT, {"model": M, "messages": USER, "max_completion_tokens": 10**9}, 400, "max_completion_tokens", "too large"),
    (CMPL, {"model": M, "prompt": "hi", "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    (CMPL, {"model": M, "prompt": "hi", "temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    (CMPL, {"model": M, "prompt": "hi", "top_p": 0}, 400, "top_p", "greater than or equal to 0.00000001"),
    (CMPL, {"model": M, "prompt": "hi", "top_p": 1e-300}, 400, "top_p", "greater than or equal to 0.00000001"),
    (CHAT, {"model": M, "messages": USER, "top_p": 5e-324}, 400, "top_p", "greater than or equal to 0.00000001"),
    (
        CMPL,
        {"model": M, "prompt": "hi", "repetition_penalty": 1e-88},
        400,
        "repetition_penalty",
        "greater than or equal to 0.01",
    ),
    (
        CHAT,
        {"model": M, "messages": USER, "repetition_penalty": 0},
        400,
        "repetition_penalty",
        "greater than or equal to 0.01",
    ),
    (
        CMPL,
        {"model": M, "prompt": "hi", "repetition_penalty": 2.5},
        400,
        "repetition_penalty",
        "less than or equal to 2",
    ),
    (CMPL, {"model": M, "prompt": "hi", "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    (CMPL, {"model": M, "prompt": "hi", "top_k": -2}, 400, "top_k", "greater than or equal to -1"),
    (CMPL, {"model": M, "prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", "less than or equal to 2"),
    (CMPL, {"model": M, "prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    (CMPL, {"model": M, "prompt": "hi", "n": 1000}, 400, "n", "less than or equal to 128"),
    (CMPL, {"model": M, "prompt": "hi", "logprobs": 6}, 400, "logprobs", "less than or equal to 5"),
    (
        CHAT,
        {"model": M, "messages": USER, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "less than or equal to 20",
    ),
    (CHAT, {"model": M, "messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "requires 'logprobs'"),
    (CMPL, {"model": M, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "up to 4"),
    (CMPL, {"model": M, "prompt": "hi", "stop": [1]}, 400, "stop", "string"),
    (CMPL, {"model": M, "prompt": "hi", "stop": ""}, 400, "stop", "non-empty"),
    (CMPL, {"model": M, "prompt": "hi", "stop": "a" * 1025}, 400, "stop", "at most 1024 characters"),
    (CHAT, {"model": M, "messages": USER, "stop": ["x", "\u00e9" * 100_000]}, 400, "stop", "at most 1024 characters"),
    (CMPL, {"model": M, "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
    (CMPL, {"model": M, "prompt": "hi", "logit_bias": {"5": 200}}, 400, "logit_bias", "[-100, 100]"),
    (CMPL, {"model": M, "prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias", "token ids"),
    (CMPL, {"model": M, "prompt": "hi", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias", "token ids"),  # "²".isdigit()
    (
        CMPL,
        {"model": M, "prompt": "hi", "logit_bias": {"\u0661\u0662": 1}},
        400,
        "logit_bias",
        "token ids",
    ),  # Arabic-Indic 12
    (CMPL, {"model": M, "prompt": "hi", "logit_bias": {"\uff11": 1}}, 400, "logit_bias", "token ids"),  # fullwidth 1
    (CMPL, {"model": M, "prompt": "hi", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias", "token ids"),
    (CMPL, {"model": M, "prompt": "hi", "logit_bias": {" 12": 1}}, 400, "logit_bias", "token ids"),
    (CMPL, {"model": M, "prompt": "hi", "logit_bias": {"+12": 1}}, 400, "logit_bias", "token ids"),
    (CMPL, {"model": M, "prompt": "hi", "logit_bias": {"1_2": 1}}, 400, "logit_bias", "token ids"),
    (CMPL, {"model": M, "prompt": "hi", "logit_bias": {"-1": 1}}, 400, "logit_bias", "token ids"),
    (CHAT, {"model": M, "messages": USER, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias", "token ids"),
    (CMPL, {"model": M, "prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids", "token ids"),
    (CMPL, {"model": M, "prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens", "must not exceed"),
    (
        CMPL,
        {"model": M, "prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "only allowed when 'stream' is true",
    ),
    (
        CMPL,
        {"model": M, "prompt": "hi", "stream": True, "stream_options": {"bogus": 1}},
        400,
        "stream_options.bogus",
        "Unrecognized",
    ),
    # empty and over-long prompts
    (CMPL, {"model": M, "prompt": ""}, 400, "prompt", "must not be empty"),
    (CMPL, {"model": M, "prompt": []}, 400, "prompt", "must not be empty"),
    (CMPL, {"model": M, "prompt": [[]]}, 400, "prompt", "must not be empty"),
    (CMPL, {"model": M, "prompt": ["ok", ""]}, 400, "prompt", "must not be empty"),
    (CMPL, {"model": M, "prompt": [99999]}, 400, "prompt", "outside the vocabulary"),
    (CMPL, {"model": M, "prompt": [-1]}, 400, "prompt", "outside the vocabulary"),
    (CMPL, {"model": M, "prompt": "word " * 400}, 400, "prompt", "maximum context length"),
    (CMPL, {"model": M, "prompt": [5] * 120, "max_tokens": 16}, 400, "prompt", "maximum context length"),
    (
        CHAT,
        {"model": M, "messages": [{"role": "user", "content": "word " * 400}]},
        400,
        "messages",
        "maximum context length",
    ),
    (CHAT, {"model": M, "messages": []}, 400, "messages", "at least 1"),
    # unknown model
    (CMPL, {"model": "gpt-4", "prompt": "hi"}, 404, "model", "does not exist"),
    (CHAT, {"model": "gpt-4", "messages": USER}, 404, "model", "does not exist"),
    # tokenizer endpoints
    ("/tokenize", {"prompt": "hi", "messages": USER}, 400, "prompt", "exactly one"),
    ("/tokenize", {}, 400, "prompt", "exactly one"),
    ("/detokenize", {"tokens": [99999]}, 400, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "expected an array"),
]


def assert_openai_error(response, status: int, param=None, contains: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert contains in error["message"], error
    return error


@pytest.mark.parametrize(
    "path,body,status,param,contains", BAD_REQUESTS, ids=[f"{i}-{case[3]}" for i, case in enumerate(BAD_REQUESTS)]
)
def test_bad_request_gets_status_and_openai_error_body(live, path, body, status, param, contains):
    before = live.engine.stats()
    assert_openai_error(live.http.post(path, json=body), status, param, contains)
    after = live.engine.stats()
    assert after.num_prompt_tokens == before.num_prompt_tokens, "a rejected request reached the engine"


@pytest.mark.parametrize(
    "raw,contains",
    [
        (b"{bad json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_malformed_json_is_400(live, raw, contains):
    response = live.http.post(CMPL, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, None, contains)


@pytest.mark.parametrize(
    "raw,contains",
    [
        (b'{"model": "%s", "prompt": "hi", "stop": %s}' % (M.encode(), b"[" * 3000 + b"]" * 3000), "nested"),
        (b'{"model": "%s", "prompt": "hi", "stop": %s}' % (M.encode(), b"[" * 100 + b"]" * 100), "nested"),
        (
            b'{"model": "%s", "prompt": "hi", "user": %s}' % (M.encode(), b'{"a": ' * 3000 + b"1" + b"}" * 3000),
            "nested",
        ),
        (b'{"model": "%s", "prompt": "hi", "seed": %s}' % (M.encode(), b"9" * 5000), "number"),
        (b'{"model": "%s", "prompt": [%s]}' % (M.encode(), b"1" * 4301), "number"),
        (b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % M.encode(), "NaN"),
        (b'{"model": "%s", "prompt": "hi", "logit_bias": {"5": -Infinity}}' % M.encode(), "Infinity"),
    ],
)
def test_json_beyond_the_parser_limits_is_400(live, raw, contains):
    for path in (CMPL, CHAT, "/tokenize"):
        response = live.http.post(path, content=raw, headers={"content-type": "application/json"})
        assert_openai_error(response, 400, None, contains)


def test_long_but_legal_numbers_get_the_fields_own_error(live):
    raw = b'{"model": "%s", "prompt": "hi", "seed": %s}' % (M.encode(), b"9" * 30)
    response = live.http.post(CMPL, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, "seed", "less than")


def test_oversize_body_is_413(live):
    huge = b'{"model": "x", "prompt": "' + b"a" * (9 * 2**20) + b'"}'
    assert_openai_error(live.http.post(CMPL, content=huge), 413, None, "limit")

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "x", "prompt": "'
        for _ in range(9):
            yield b"a" * 2**20
        yield b'"}'

    assert_openai_error(live.http.post(CMPL, content=chunked()), 413, None, "limit")


def test_unknown_route_and_wrong_method_use_openai_body(live):
    """A route no handler takes names itself and what is served; an OpenAI endpoint we do not
    serve is a 501 naming the API, so a client reports that rather than a missing model."""
    error = assert_openai_error(live.http.post("/v1/nope", json={}), 404, None, "Unknown route: POST /v1/nope")
    assert error["code"] == "not_found" and "POST /v1/chat/completions" in error["message"]
    assert assert_openai_error(live.http.get(CMPL), 405, None, "GET is not allowed")["code"] == "method_not_allowed"
    assert_openai_error(live.http.get("/v1/models/gpt-4"), 404, "model", "does not exist")
    for path, api in (
        ("/v1/embeddings", "embeddings"),
        ("/v1/audio/speech", "audio"),
        ("/v1/moderations", "moderations"),
    ):
        error = assert_openai_error(live.http.post(path, json={"model": M}), 501, None, api)
        assert error["code"] == "not_implemented" and "does not serve" in error["message"]
    import openai

    with pytest.raises(openai.APIStatusError) as raised:
        live.client().embeddings.create(model=M, input="hi")
    assert raised.value.status_code == 501 and "embeddings" in raised.value.message


def test_off_values_of_unsupported_fields_are_accepted(live):
    body = {
        "model": M,
        "messages": USER,
        "max_tokens": 2,
        "response_format": {"type": "text"},
        "tools": [],
        "store": False,
        "best_of": None,
    }
    body.pop("best_of")
    assert live.http.post(CHAT, json=body).status_code == 200
    assert live.http.post(CMPL, json={"model": M, "prompt": "hi", "max_tokens": 2, "best_of": 1}).status_code == 200


def test_router_fields_at_values_we_honour_and_metadata_are_accepted(live):
    """What vllm-router / SGLang's router add to every request, at their defaults (or what we
    honour), does not stop a request; SGLang's max_completion_tokens works on completions."""
    router = {
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
        "include_reasoning": True,
    }
    meta = {"metadata": {"user": "u1", "k" * 64: "v" * 512}}
    done = live.http.post(
        CMPL, json={"model": M, "prompt": "Hello", "max_completion_tokens": 3, "temperature": 0, **router, **meta}
    )
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 3
    chat = live.http.post(
        CHAT,
        json={
            "model": M,
            "messages": USER,
            "max_completion_tokens": 2,
            "continue_final_message": False,
            **router,
            **meta,
        },
    )
    assert chat.status_code == 200, chat.text
    live.wait_idle()


def test_chat_template_kwargs_reach_the_template(live):
    """{"enable_thinking": false} and the like are variables of the model's own template."""
    from server.serving_chat import encode_chat
    from tests.models.conftest import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %} no-think{% endif %}"
    )
    plain = tokenizer.decode(encode_chat(tokenizer, USER))
    told = tokenizer.decode(encode_chat(tokenizer, USER, template_kwargs={"enable_thinking": False}))
    assert "no-think" not in plain and told.endswith("no-think")
    chat = live.http.post(
        CHAT, json={"model": M, "messages": USER, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert chat.status_code == 200, chat.text


def test_vllm_named_gauges_sit_beside_ours(live):
    """The gauges routers and autoscalers read (Gateway API Inference Extension, llm-d, KEDA),
    under vLLM's names and model_name label, agree with ours."""
    text = live.http.get("/metrics").text
    label = f'model_name="{M}"'
    assert f"vllm:num_requests_running{{{label}}}" in text and f"vllm:num_requests_waiting{{{label}}}" in text
    usage = live.metric("vllm:kv_cache_usage_perc", label)
    used, total = live.metric("pagedserve:kv_blocks_used"), live.metric("pagedserve:kv_blocks_total")
    assert 0 <= usage <= 1 and usage == pytest.approx(used / total)
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert f'num_gpu_blocks="{int(total)}"' in info and 'block_size="' in info and info.endswith(" 1.0")


def test_server_still_serves_after_a_burst_of_bad_requests(live):
    for path, body, status, _, _ in BAD_REQUESTS * 3:
        assert live.http.post(path, json=body).status_code == status
    for _ in range(20):
        assert live.http.post(CMPL, content=b"{nope").status_code == 400
    good = live.http.post(CMPL, json={"model": M, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert good.status_code == 200
    assert good.json()["usage"]["completion_tokens"] == 4
    chat = live.client().chat.completions.create(model=M, messages=USER, max_tokens=3)
    assert chat.choices[0].finish_reason in ("stop", "length")
    live.wait_idle()


LONE_SURROGATE = rb'"a\ud800b"'  # a JSON escape that decodes to a str no UTF-8 can encode


@pytest.mark.parametrize(
    "path,raw,param",
    [
        (CMPL, b'{"model": "%s", "prompt": %s}' % (M.encode(), LONE_SURROGATE), "prompt"),
        (CMPL, b'{"model": "%s", "prompt": ["ok", %s]}' % (M.encode(), LONE_SURROGATE), "prompt[1]"),
        (CMPL, b'{"model": "%s", "prompt": "hi", "stop": [%s]}' % (M.encode(), LONE_SURROGATE), "stop[0]"),
        (CMPL, b'{"model": "%s", "prompt": "hi", "logit_bias": {%s: 1}}' % (M.encode(), LONE_SURROGATE), "logit_bias"),
        (
            CHAT,
            b'{"model": "%s", "messages": [{"role": "user", "content": %s}]}' % (M.encode(), LONE_SURROGATE),
            "messages[0].content",
        ),
        (
            CHAT,
            b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}'
            % (M.encode(), LONE_SURROGATE),
            "messages[0].content[0].text",
        ),
        ("/tokenize", b'{"prompt": %s}' % LONE_SURROGATE, "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
    ],
)
def test_invalid_unicode_is_400_before_the_tokenizer(live, path, raw, param):
    before = live.engine.stats()
    response = live.http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, param, "Unicode")
    assert live.engine.stats().num_prompt_tokens == before.num_prompt_tokens


def test_escaped_surrogate_pairs_are_valid_unicode(live):
    raw = b'{"model": "%s", "prompt": "\\ud83d\\ude00 hi", "max_tokens": 1}' % M.encode()  # U+1F600
    response = live.http.post(CMPL, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
