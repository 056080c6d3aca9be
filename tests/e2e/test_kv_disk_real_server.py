"""End to end: `python -m server --kv-cache-disk DIR` on the default SmolLM2-135M-Instruct. A long chat
(a 2,000-token system prompt) answered cold, the server stopped and started again on the same
directory: the restarted server computes only the prompt's tail, reads the rest from disk, and
answers with the same tokens and logprobs, through the official openai client over a real socket."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import served

pytestmark = pytest.mark.slow  # the real model served twice, a 2,000-token prefill

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = " ".join(f"Rule {i}: answer politely, briefly and in plain English, citing rule {i}." for i in range(120))
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", autouse=True)
def model_path():
    from models.fetch import default_model_path

    return default_model_path()  # fetched (once) before a server's clock starts


def disk_hits(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith('pagedserve:prefix_cache_hits_total{tier="disk"}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no disk-tier hit counter in /metrics")


def ask(url: str):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=1
    )


def test_a_restarted_server_answers_a_long_prompt_from_disk_as_it_did_cold(tmp_path):
    flags = ("--max-model-len", "4096", "--kv-cache-disk", str(tmp_path / "kv"), "--log-level", "warning")
    with served(*flags) as url:
        cold = ask(url)
        assert disk_hits(url) == 0
    assert cold.usage.prompt_tokens >= 2000
    assert len(list((tmp_path / "kv").glob("*.kvb"))) >= 2000 // 16  # every full block, written at shutdown

    with served(*flags) as url:
        warm = ask(url)
        hits = disk_hits(url)
    assert warm.choices[0].message.content == cold.choices[0].message.content
    got = [t.logprob for t in warm.choices[0].logprobs.content]
    want = [t.logprob for t in cold.choices[0].logprobs.content]
    assert got == pytest.approx(want, abs=1e-4)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert hits == cached and cached >= warm.usage.prompt_tokens - 16
