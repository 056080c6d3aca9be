"""Prompt logprobs: every prompt token's logprob given the tokens before it equals transformers'
log_softmax on the same float32 weights, whether the prompt is computed in one step, in chunks,
after a prefix-cache hit another request left, or again after a preemption."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams
from tests.engine.test_engine import run_core

VOCAB = 300
TOL = 1e-4


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """(len(prompt) - 1, vocab): row i is the log-distribution of prompt token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_against_hf(hf_model, prompt, got, num_top):
    expected = hf_prompt_logprobs(hf_model, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for i, lp in enumerate(got[1:]):
        row = expected[i]
        assert lp.token_id == prompt[i + 1]
        assert abs(lp.logprob - row[prompt[i + 1]].item()) < TOL, i
        target = row[prompt[i + 1]]
        assert int((row > target + TOL).sum()) + 1 <= lp.rank <= int((row > target - TOL).sum()) + 1
        assert len(lp.top) == num_top
        top_values = row.topk(num_top).values.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values, abs=TOL)
        for token_id, value in lp.top:
            assert abs(row[token_id].item() - value) < TOL


def test_prompt_logprobs_chunked_and_after_a_prefix_hit_equal_transformers(loaded, tiny_llama):
    _, hf_model = tiny_llama
    rng = random.Random(7)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    first = shared + [rng.randrange(3, VOCAB) for _ in range(9)]  # 49 tokens: 4+ chunks of 12
    second = shared + [rng.randrange(3, VOCAB) for _ in range(5)]
    core = EngineCore(
        loaded,
        EngineConfig(
            block_size=4, num_kv_blocks=128, max_num_batched_tokens=12, max_num_seqs=4, audit_interval_steps=1
        ),
    )
    asked = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    outputs = []
    results = run_core(core, [("a", first, asked)], on_step=outputs.extend)
    check_against_hf(hf_model, first, _prompt_logprobs(outputs, "a"), 3)
    assert len(results["a"]["token_ids"]) == 3

    # A plain request caches the shared prefix; then one asking for prompt logprobs still
    # gets every position (its prefix is computed again), and one not asking uses the hit.
    run_core(core, [("warm", shared + [5, 6], SamplingParams(temperature=0, max_tokens=1))])
    outputs = []
    results = run_core(
        core,
        [
            ("b", second, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)),
            ("c", second, SamplingParams(temperature=0, max_tokens=2)),
        ],
        on_step=outputs.extend,
    )
    check_against_hf(hf_model, second, _prompt_logprobs(outputs, "b"), 0)
    assert results["b"]["final"].num_cached_tokens == 0
    assert results["c"]["final"].num_cached_tokens >= 40
    assert _prompt_logprobs(outputs, "c") is None
    assert results["b"]["token_ids"] == results["c"]["token_ids"]
    assert core.audit() == [] and core.scheduler.block_manager.num_used_blocks == 0


def test_prompt_logprobs_survive_preemption(loaded, tiny_llama):
    """A pool too small for all: requests are preempted and recompute; each still gets its
    prompt logprobs once, equal to transformers'."""
    _, hf_model = tiny_llama
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(3, VOCAB) for _ in range(14 + 3 * i)] for i in range(4)}
    core = EngineCore(
        loaded,
        EngineConfig(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=4, audit_interval_steps=1),
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outputs = []
    run_core(core, [(rid, p, params) for rid, p in prompts.items()], on_step=outputs.extend)
    assert core.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert sum(o.prompt_logprobs is not None for o in outputs if o.request_id == rid) == 1
        check_against_hf(hf_model, prompt, _prompt_logprobs(outputs, rid), 1)


def test_no_prompt_logprobs_rows_unless_asked(loaded):
    """The hot path: a request that does not ask adds no logit rows to its prefill."""
    core = EngineCore(loaded, EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64))
    core.add_request("x", list(range(3, 30)), SamplingParams(max_tokens=1))
    scheduled = core.scheduler.schedule().scheduled
    assert [len(s.prompt_logprob_rows) for s in scheduled] == [0]


def _prompt_logprobs(outputs, request_id):
    found = [o.prompt_logprobs for o in outputs if o.request_id == request_id and o.prompt_logprobs is not None]
    assert len(found) <= 1
    return found[0] if found else None


def test_prompt_logprobs_over_two_tensor_parallel_ranks_equal_one(tiny_llama):
    """Every rank computes the prompt rows' logits too (they are in the step's logit rows)."""
    from engine.llm import LLM

    path = str(tiny_llama[0])
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (30, 9)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    engine = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    expected = LLM(path, dtype="float32", **engine).generate(prompts, params)
    with LLM(path, dtype="float32", tensor_parallel_size=2, **engine) as llm:
        got = llm.generate(prompts, params)
    for one, two in zip(expected, got):
        assert two.token_ids == one.token_ids and two.prompt_logprobs[0] is None
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
            assert (b.token_id, [t for t, _ in b.top]) == (a.token_id, [t for t, _ in a.top])
            assert abs(a.logprob - b.logprob) < TOL
