"""End to end: `python -m server --kv-cache-dtype int8` on the default SmolLM2-135M-Instruct, driven
by the official openai client over a real socket, against the offline engine on the same model and
cache dtype in this process."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.server.conftest import served

MODEL = "SmolLM2-135M-Instruct"
KV_CACHE_GIB = 0.25
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def model_path() -> Path:
    from models.fetch import default_model_path

    return default_model_path()  # fetched (once) before a server's clock starts


@pytest.fixture(scope="module")
def server(model_path):
    with served(
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        str(KV_CACHE_GIB),
        "--kv-cache-dtype",
        "int8",
        "--log-level",
        "warning",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def offline(model_path):
    from engine.llm import LLM

    return LLM(str(model_path), kv_cache_dtype="int8", num_kv_blocks=64)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_greedy_completion_equals_the_offline_engine_with_an_int8_cache(client, offline):
    """The same prompt ids, greedy: the server's text and logprobs are the offline engine's (both
    read the int8 cache through the same kernels; a row's result does not depend on its step)."""
    from engine.request import SamplingParams

    ids = offline.tokenizer("The three primary colors are").input_ids
    [ref] = offline.generate([ids], SamplingParams(max_tokens=24, temperature=0, logprobs=0))
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, logprobs=1)
    choice = got.choices[0]
    assert choice.text == ref.text
    assert got.usage.completion_tokens == len(ref.token_ids)
    assert ref.logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)
    assert len(ref.text.split()) >= 3  # words, not a stuck token


def test_streamed_chat_answers_and_equals_the_whole_reply(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    answer = whole.choices[0].message.content
    assert "Paris" in answer
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_metrics_show_the_int8_cache_capacity(server, offline):
    """/metrics: the pool's blocks x block size are the tokens held; its bytes a token are the int8
    rows' (float16 scales included), 1.94x fewer than a 16-bit cache's for SmolLM2's head dim of 64."""
    from models.layers.attention import KVCacheSpec

    spec: KVCacheSpec = offline.engine.runner.kv_cache_spec
    blocks = metric(server, "pagedserve:kv_blocks_total")
    info = httpx.get(f"{server}/metrics", timeout=30).text
    [block_size] = [
        int(part.split('"')[1])
        for line in info.splitlines()
        if line.startswith("pagedserve:cache_config_info{") or line.startswith("vllm:cache_config_info{")
        for part in line.split(",")
        if "block_size=" in part
    ]
    tokens = blocks * block_size
    kv_bytes = metric(server, "pagedserve:kv_cache_bytes")
    assert kv_bytes == tokens * spec.bytes_per_token <= KV_CACHE_GIB * 2**30
    sixteen_bit = KVCacheSpec(spec.num_layers, spec.entry_shape, torch.bfloat16).bytes_per_token
    assert tokens / (KV_CACHE_GIB * 2**30 / sixteen_bit) >= 1.9  # 128 / 66 bytes a row, less a block's rounding
