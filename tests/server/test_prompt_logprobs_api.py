"""Prompt logprobs over a real socket: echo + logprobs (OpenAI's legacy object, as
lm-evaluation-harness reads it) and vLLM's prompt_logprobs, equal to transformers' log_softmax
on the same float32 checkpoint."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.server.conftest import MODEL_NAME

M = MODEL_NAME
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """prompt ids -> (len - 1, vocab) log-distributions of prompt tokens 1.. from transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]

    logprobs.tokenizer = tokenizer
    return logprobs


def prompt_ids(reference, text: str) -> list[int]:
    return list(reference.tokenizer(text)["input_ids"])


def test_echo_logprobs_with_max_tokens_0_scores_every_prompt_token(live, reference):
    text = "The quick brown fox jumps over the lazy dog, again and again."
    ids = prompt_ids(reference, text)
    body = {"model": M, "prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    response = live.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    choice = result["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    expected = reference(ids)
    for i, value in enumerate(lp["token_logprobs"][1:]):
        assert abs(value - expected[i, ids[i + 1]].item()) < TOL
        assert abs(max(lp["top_logprobs"][i + 1].values()) - expected[i].max().item()) < TOL
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["text"] == reference.tokenizer.decode(ids)
    assert choice["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 0 and result["usage"]["prompt_tokens"] == len(ids)


def test_echo_logprobs_as_lm_eval_sends_them(live, reference):
    """lm-evaluation-harness: token-id prompts, several per request, echo, max_tokens 1, logprobs 1;
    it reads token_logprobs[ctxlen:-1] (the prompt's) and drops the one generated token."""
    prompts = [[5, 17, 40, 3, 99, 12, 8], [7, 7, 7, 120, 64]]
    client = live.client()
    result = client.completions.create(model=M, prompt=prompts, echo=True, max_tokens=1, logprobs=1, temperature=0)
    for choice, ids in zip(sorted(result.choices, key=lambda c: c.index), prompts):
        values = choice.logprobs.token_logprobs
        assert len(values) == len(ids) + 1 and values[0] is None
        expected = reference(ids)
        assert values[1:-1] == pytest.approx([expected[i, ids[i + 1]].item() for i in range(len(ids) - 1)], abs=TOL)
        greedy = choice.logprobs.top_logprobs[-1]
        assert values[-1] == pytest.approx(max(greedy.values()), abs=TOL)  # temperature 0 took the best


def test_echo_logprobs_stream_equals_the_whole_response(live):
    body = {
        "model": M,
        "prompt": [5, 17, 40, 3, 99],
        "echo": True,
        "logprobs": 2,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = live.http.post("/v1/completions", json=body).json()["choices"][0]
    with live.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    tokens, values, text = [], [], ""
    for event in events:
        for choice in event["choices"]:
            text += choice["text"]
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                values += choice["logprobs"]["token_logprobs"]
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"] and len(tokens) == 5 + 3
    assert values[0] is None and values[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=TOL)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_prompt_logprobs_field(live, reference, path):
    if path == "/v1/completions":
        body = {"model": M, "prompt": [5, 17, 40, 3, 99, 12], "max_tokens": 2, "prompt_logprobs": 2}
    else:
        body = {
            "model": M,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 2,
            "prompt_logprobs": 2,
        }
    response = live.http.post(path, json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    prompt_logprobs = result["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == result["usage"]["prompt_tokens"] and prompt_logprobs[0] is None
    if path == "/v1/completions":
        ids = body["prompt"]
    else:  # the prompt the chat template made
        ids = live.http.post("/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    expected = reference(ids)
    for i, position in enumerate(prompt_logprobs[1:]):
        token = ids[i + 1]
        entry = position[str(token)]
        assert abs(entry["logprob"] - expected[i, token].item()) < TOL
        assert entry["rank"] == int((expected[i] > expected[i, token]).sum()) + 1
        assert entry["decoded_token"] == reference.tokenizer.decode([token])
        assert 2 <= len(position) <= 3
        best = max(position.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1 and abs(best["logprob"] - expected[i].max().item()) < TOL
    assert "prompt_logprobs" not in live.http.post(path, json={**body, "prompt_logprobs": None}).json()["choices"][0]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "logprobs": 6}, "logprobs"),
    ],
)
def test_bad_prompt_logprob_requests_are_openai_400s(live, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        live.client().completions.create(model=M, prompt="hi", extra_body=extra)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
