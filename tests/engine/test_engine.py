"""The engine end to end on a tiny random Llama in float32: batching, preemption, prefix
caching, chunked prefill and failures must never change a request's greedy output."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.llm import LLM
from engine.request import RequestStatus, SamplingParams

VOCAB = 300
GAP_TOL = 1e-3


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def random_prompt(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def run_core(core: EngineCore, requests, on_step=None):
    """requests: [(id, prompt ids, params)], added together; returns id -> result, auditing every step."""
    results = {}
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
        results[rid] = {"token_ids": [], "text": "", "final": None}
    while core.has_unfinished:
        outputs = core.step()
        assert core.audit() == []
        for out in outputs:
            r = results[out.request_id]
            r["token_ids"] += out.token_ids
            r["text"] += out.text
            if out.finished:
                r["final"] = out
        if on_step:
            on_step(outputs)
    return results


def solo_outputs(loaded, requests, **config):
    core = EngineCore(loaded, EngineConfig(**config))
    return {rid: run_core(core, [(rid, p, params)])[rid]["token_ids"] for rid, p, params in requests}


def assert_pool_empty(core):
    bm = core.scheduler.block_manager
    assert core.audit() == []
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks


def hf_greedy(hf_model, prompt, max_tokens):
    """transformers' greedy tokens and, per step, the gap between its two best log-probs."""
    config = copy.deepcopy(hf_model.generation_config)
    # None would fall back to the checkpoint's EOS; an id outside the vocabulary never stops it.
    config.update(
        eos_token_id=VOCAB,
        max_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    gaps = []
    for logits in out.logits:
        top2 = torch.log_softmax(logits[0].float(), -1).topk(2).values
        gaps.append((top2[0] - top2[1]).item())
    return out.sequences[0, len(prompt) :].tolist(), gaps


def agrees_until_near_tie(ours, ref, gaps):
    """Token-for-token equal up to the first step where the reference's top-2 gap < GAP_TOL."""
    for a, b, gap in zip(ours, ref, gaps):
        if gap < GAP_TOL:
            return True
        if a != b:
            return False
    return len(ours) == len(ref)


def test_32_concurrent_greedy_requests_match_solo_runs_and_transformers(loaded, tiny_llama):
    rng = random.Random(0)
    requests = [(f"r{i}", random_prompt(rng, rng.randint(1, 70)), greedy(rng.randint(1, 40))) for i in range(32)]
    config = dict(block_size=8, num_kv_blocks=512, max_num_seqs=32, max_num_batched_tokens=96)
    core = EngineCore(loaded, EngineConfig(**config))
    batched = run_core(core, requests)
    assert_pool_empty(core)
    solo = solo_outputs(loaded, requests, **config)
    hf_model = tiny_llama[1]
    exact_hf = agree_hf = 0
    for rid, prompt, params in requests:
        ours = batched[rid]["token_ids"]
        assert len(ours) == params.max_tokens and batched[rid]["final"].finish_reason == "length"
        assert ours == solo[rid], rid
        ref, gaps = hf_greedy(hf_model, prompt, params.max_tokens)
        exact_hf += ours == ref
        agree_hf += agrees_until_near_tie(ours, ref, gaps)
        if not agrees_until_near_tie(ours, ref, gaps):
            print(rid, len(prompt), ours, ref, [round(g, 4) for g in gaps])
    print(
        f"\n32 concurrent greedy requests: 32/32 equal to solo runs, {agree_hf}/32 agree with transformers "
        f"up to a near-tie (top-2 gap < {GAP_TOL}), {exact_hf}/32 whole outputs identical to transformers"
    )
    assert agree_hf == 32


def test_pool_too_small_preempts_and_outputs_are_unchanged(loaded):
    rng = random.Random(1)
    requests = [(f"p{i}", random_prompt(rng, rng.randint(4, 20)), greedy(rng.randint(10, 30))) for i in range(9)]
    # Seeded random sampling: each request draws from its own generator, so neither the
    # batch around it nor a recompute after preemption may change its tokens.
    requests += [
        (
            f"s{i}",
            random_prompt(rng, 12),
            SamplingParams(temperature=1.0, top_k=20, seed=i, max_tokens=25, ignore_eos=True),
        )
        for i in range(3)
    ]
    config = dict(block_size=4, num_kv_blocks=24, max_num_seqs=12, max_num_batched_tokens=64)
    core = EngineCore(loaded, EngineConfig(**config))
    results = run_core(core, requests)
    assert_pool_empty(core)
    assert core.stats().num_preemptions > 0
    solo = solo_outputs(loaded, requests, **config)
    for rid, _, params in requests:
        assert results[rid]["token_ids"] == solo[rid]
        assert len(solo[rid]) == params.max_tokens
    print(
        f"\nsmall pool: {core.stats().num_preemptions} preemptions, 12/12 outputs (3 seeded random) equal to solo runs"
    )


def test_prefix_cache_computes_only_uncached_tokens(loaded):
    rng = random.Random(2)
    shared = random_prompt(rng, 48)  # 3 blocks of 16
    first, second = shared + random_prompt(rng, 5), shared + random_prompt(rng, 7)
    core = EngineCore(loaded, EngineConfig(block_size=16, num_kv_blocks=64))
    run_core(core, [("first", first, greedy(6))])
    before = core.stats()
    result = run_core(core, [("second", second, greedy(6))])["second"]
    after = core.stats()
    assert result["final"].num_cached_tokens == 48
    assert after.num_computed_tokens - before.num_computed_tokens == 7 + 5  # the suffix, then 5 decodes
    assert after.prefix_cache_hits - before.prefix_cache_hits == 48
    uncached = solo_outputs(
        loaded, [("second", second, greedy(6))], block_size=16, num_kv_blocks=64, enable_prefix_caching=False
    )
    assert result["token_ids"] == uncached["second"]
    assert_pool_empty(core)


def test_samples_of_one_prompt_added_together_share_its_blocks(loaded):
    prompt = random_prompt(random.Random(3), 40)  # 2 full blocks of 16 + 8 tokens
    core = EngineCore(loaded, EngineConfig(block_size=16, num_kv_blocks=64))
    results = run_core(core, [(f"n-{i}", prompt, greedy(5)) for i in range(3)])
    assert [results[f"n-{i}"]["final"].num_cached_tokens for i in range(3)] == [0, 32, 32]
    assert core.stats().num_computed_tokens == 40 + 2 * 8 + 3 * 4
    assert len({tuple(r["token_ids"]) for r in results.values()}) == 1


def test_chunked_prefill_never_starves_decodes(loaded):
    rng = random.Random(4)
    decoders = [(f"d{i}", random_prompt(rng, 6), greedy(30)) for i in range(4)]
    long = ("long", random_prompt(rng, 180), greedy(4))
    config = dict(block_size=8, num_kv_blocks=128, max_num_batched_tokens=32, max_num_seqs=8)
    core = EngineCore(loaded, EngineConfig(**config))
    for rid, prompt, params in decoders:
        core.add_request(rid, prompt, params)
    results = {rid: [] for rid, _, _ in decoders + [long]}
    for out in core.step() + core.step():
        results[out.request_id] += out.token_ids
    core.add_request(*long)
    decode_tokens_per_step = []
    while core.has_unfinished:
        outputs = core.step()
        assert core.audit() == []
        for out in outputs:
            results[out.request_id] += out.token_ids
        if not results["long"]:
            decode_tokens_per_step.append(sum(len(o.token_ids) for o in outputs if o.request_id != "long"))
    # 180 prompt tokens with 28 of every 32-token budget: 7 steps of prefill chunks.
    assert len(decode_tokens_per_step) >= 6
    assert decode_tokens_per_step[:-1] == [4] * (len(decode_tokens_per_step) - 1)
    solo = solo_outputs(loaded, decoders + [long], **config)
    assert results == solo
    assert_pool_empty(core)


class ExplodingModel:
    """Wraps the model; its forward raises on chosen calls (a failure of a whole batch)."""

    def __init__(self, model, fail_on_calls):
        self.model, self.fail_on_calls, self.num_calls = model, set(fail_on_calls), 0

    def __call__(self, *args):
        self.num_calls += 1
        if self.num_calls in self.fail_on_calls:
            raise RuntimeError("injected forward failure")
        return self.model(*args)

    def compute_logits(self, hidden, kernels):
        return self.model.compute_logits(hidden, kernels)


def test_every_block_returns_after_finish_abort_preemption_and_failures(loaded):
    rng = random.Random(5)
    core = EngineCore(
        loaded,
        EngineConfig(block_size=4, num_kv_blocks=32, max_num_batched_tokens=24, max_num_seqs=6, audit_interval_steps=1),
    )
    good = [(f"g{i}", random_prompt(rng, rng.randint(3, 12)), greedy(rng.randint(15, 30))) for i in range(12)]
    core.add_request("abort-prefill", random_prompt(rng, 60), greedy(5))
    core.add_request("abort-decode", random_prompt(rng, 3), greedy(40))
    for r in good:
        core.add_request(*r)
    core.add_request("bad-sampling", random_prompt(rng, 5), greedy(10, logit_bias={10**6: 1.0}))
    core.add_request("abort-waiting", random_prompt(rng, 9), greedy(5))
    finals = {}
    for step in range(1, 400):
        if step == 11:
            core.runner.model = ExplodingModel(core.runner.model, fail_on_calls=[1])  # step 11's forward
        if step == 3:
            assert 0 < core.scheduler.get_request("abort-prefill").num_computed_tokens < 60
            assert core.scheduler.get_request("abort-waiting").status is RequestStatus.WAITING
            finals["abort-prefill"] = core.abort_request("abort-prefill")
            finals["abort-waiting"] = core.abort_request("abort-waiting")
        if step == 8 and core.scheduler.get_request("abort-decode"):
            assert core.scheduler.get_request("abort-decode").num_output_tokens > 0
            finals["abort-decode"] = core.abort_request("abort-decode")
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
        assert core.audit() == []
        if not core.has_unfinished:
            break
    assert_pool_empty(core)
    stats = core.stats()
    print(f"\nmixed run: {stats}")
    assert stats.num_preemptions > 0 and stats.num_failed_steps == 1 and stats.num_audit_discrepancies == 0
    assert finals["bad-sampling"].finish_reason == "error" and "logit_bias" in finals["bad-sampling"].error
    for rid in ("abort-prefill", "abort-decode", "abort-waiting"):
        assert finals[rid].finish_reason == "abort"
    failed = [rid for rid, out in finals.items() if out.finish_reason == "error" and rid != "bad-sampling"]
    assert failed and all("injected forward failure" in finals[rid].error for rid in failed)
    survivors = [rid for rid, _, _ in good if finals[rid].finish_reason == "length"]
    assert survivors  # the engine kept serving after the failed step
    # The engine still serves: a new request after all that.
    assert run_core(core, [("after", [5, 6, 7], greedy(3))])["after"]["final"].finish_reason == "length"
    assert_pool_empty(core)


def test_llm_generate_offline(loaded):
    llm = LLM.from_loaded(loaded, num_kv_blocks=64)
    tok = loaded.tokenizer
    results = llm.generate(["Hello world", [5, 6, 7]], greedy(8))
    assert results[0].prompt_token_ids == tok("Hello world")["input_ids"]
    for r in results:
        assert len(r.token_ids) == 8 and r.finish_reason == "length"
        assert r.text == tok.decode(r.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    again = llm.generate([[5, 6, 7]], greedy(8))[0]
    assert again.token_ids == results[1].token_ids
    with pytest.raises(ValueError, match="context length"):
        llm.generate(["x"], greedy(10_000))


def test_stop_strings_and_stop_tokens_end_requests(loaded):
    llm = LLM.from_loaded(loaded, num_kv_blocks=64)
    base = llm.generate([[9, 10, 11, 12]], greedy(20))[0]
    stop_token = base.token_ids[5]
    stopped = llm.generate([[9, 10, 11, 12]], greedy(20, stop_token_ids=(stop_token,)))[0]
    first = base.token_ids.index(stop_token)
    assert stopped.token_ids == base.token_ids[: first + 1] and stopped.stop_reason == stop_token
    assert stopped.finish_reason == "stop"
    text = base.text
    assert len(text) >= 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    s = llm.generate([[9, 10, 11, 12]], greedy(20, stop=(stop,)))[0]
    assert s.finish_reason == "stop" and s.stop_reason == stop and s.text == text[: text.index(stop)]
    assert len(s.token_ids) < 20
    # The token that completes the stop string is also the last max_tokens allows: the stop string wins.
    last = llm.generate([[9, 10, 11, 12]], greedy(len(s.token_ids), stop=(stop,)))[0]
    assert (last.finish_reason, last.stop_reason, last.text) == ("stop", stop, s.text)


def test_pool_size_comes_from_memory_and_the_models_kv_spec(loaded):
    from transformers import DeepseekV3Config

    from models.deepseek import DeepseekV3ForCausalLM

    core = EngineCore(loaded, EngineConfig(kv_cache_memory_gib=0.001, block_size=16))
    gqa = core.runner.kv_cache_spec
    assert gqa.bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head_dim x float32
    assert core.runner.num_blocks == int(0.001 * 2**30) // (16 * gqa.bytes_per_token)
    assert core.runner.kv_caches[0].shape == (core.runner.num_blocks, 16, 2, 2, 16)
    hf_config = DeepseekV3Config(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        kv_lora_rank=24,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        q_lora_rank=None,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    )
    with torch.device("meta"):
        mla = DeepseekV3ForCausalLM(hf_config, 64).kv_cache_spec(torch.float32)
    assert mla.bytes_per_token == 2 * (24 + 8) * 4  # one latent per token per layer
    config = EngineConfig(kv_cache_memory_gib=0.001)
    assert config.resolve_num_blocks(mla.bytes_per_token, 64) > config.resolve_num_blocks(gqa.bytes_per_token, 64)
    # With no size given: 1 GiB, capped at what max_num_seqs full-length requests can use.
    assert EngineConfig(max_num_seqs=4).resolve_num_blocks(gqa.bytes_per_token, 256) == 4 * 256 // 16


def test_logprobs_follow_each_token(loaded):
    llm = LLM.from_loaded(loaded, num_kv_blocks=64)
    r = llm.generate([[3, 4, 5]], greedy(6, logprobs=2))[0]
    assert len(r.logprobs) == 6
    for token_id, lp in zip(r.token_ids, r.logprobs):
        assert lp.token_id == token_id and len(lp.top) == 2
        assert lp.top[0][0] == token_id and lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
    assert llm.generate([[3, 4, 5]], greedy(6))[0].logprobs is None


def test_a_token_outside_the_vocabulary_ends_only_its_own_request(loaded, monkeypatch):
    """Whatever the sampler returns, an id outside [0, vocab) fails that request alone, before
    it can reach the next forward pass (where it would take the whole batch down)."""
    import engine.verification as verification

    real_sample = verification.sample

    def sample_with_a_bad_row(logits, batch):
        out = real_sample(logits, batch)
        ids = [VOCAB + 7 if p.repetition_penalty == 0.5 else t for p, t in zip(batch_params, out.token_ids)]
        return type(out)(ids, out.logprobs)

    real_from_params = verification.SamplingBatch.from_params
    batch_params = []

    def from_params(params, *args, **kwargs):
        batch_params[:] = params
        return real_from_params(params, *args, **kwargs)

    monkeypatch.setattr(verification, "sample", sample_with_a_bad_row)
    monkeypatch.setattr(verification.SamplingBatch, "from_params", from_params)
    core = EngineCore(loaded, EngineConfig(block_size=4, num_kv_blocks=64))
    requests = [("good", [5, 6, 7], greedy(6)), ("bad", [8, 9], greedy(6, repetition_penalty=0.5))]
    expected = solo_outputs(loaded, requests[:1], block_size=4, num_kv_blocks=64)
    results = run_core(core, requests)
    results.update(run_core(core, [("alone-bad", [3, 4], greedy(6, repetition_penalty=0.5))]))  # a batch of one
    for rid in ("bad", "alone-bad"):
        assert results[rid]["final"].finish_reason == "error" and "vocabulary" in results[rid]["final"].error
    assert results["good"]["final"].finish_reason == "length"
    assert results["good"]["token_ids"] == expected["good"]
    assert core.stats().num_failed_steps == 0
    assert_pool_empty(core)


def test_a_seeded_request_stays_reproducible_through_the_row_by_row_retry(loaded, monkeypatch):
    """The batch attempt fails after the seeded generators drew: the retry draws the same numbers."""
    from engine.model_runner import ModelRunner

    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    requests = [("seeded", [5, 6, 7], seeded), ("other", [8, 9], greedy(12))]
    expected = solo_outputs(loaded, requests[:1], block_size=4, num_kv_blocks=64)
    real_sample_rows = ModelRunner._sample_rows
    failed = []

    def fails_for_batches(self, logits, scheduled):
        out = real_sample_rows(self, logits, scheduled)  # the generators have drawn by now
        if len(scheduled) > 1:
            failed.append(len(scheduled))
            raise RuntimeError("batch sampling failed")
        return out

    monkeypatch.setattr(ModelRunner, "_sample_rows", fails_for_batches)
    core = EngineCore(loaded, EngineConfig(block_size=4, num_kv_blocks=64))
    results = run_core(core, requests)
    assert failed and results["other"]["final"].finish_reason == "length"
    assert results["seeded"]["token_ids"] == expected["seeded"]
