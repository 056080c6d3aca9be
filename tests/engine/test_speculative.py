"""Speculative decoding: the n-gram proposer, the policy, and verification that is exact.

Verification is checked on synthetic logits (a fixed random "model" over a small vocabulary):
seeded requests give exactly the tokens, logprobs and generator states of decoding without
drafts, for every sampling feature, with drafts that are likely, unlikely and forbidden; and the
distribution of unseeded outputs equals decoding without drafts (chi-square), which a verifier
with a classic bug fails.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import verification
from engine.verification import sample_requests
from engine.request import RequestStatus, SamplingParams
from engine.speculative import NgramIndex, SpeculativeConfig, Speculator, expected_tokens
from engine.step import ScheduledRequest

# ----------------------------------------------------------------------------- n-gram index


def brute_force_proposal(tokens, k, ngram_min, ngram_max):
    """The continuation of the most recent earlier occurrence of the longest suffix that has one,
    read on into the draft itself where it reaches the end (a text that repeats goes on repeating)."""
    for n in range(ngram_max, ngram_min - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # occurrences ending before the last token
            if tokens[start : start + n] == suffix:
                extended = list(tokens)
                for position in range(start + n, start + n + k):
                    extended.append(extended[position])
                return extended[len(tokens) :]
    return []


def test_ngram_proposes_what_followed_the_suffix_last_time():
    index = NgramIndex(2, 4)
    a, b, c, d, x, y = range(1, 7)
    assert index.propose([a, b, c, d, x, a, b, c], 3) == [d, x, a]
    index = NgramIndex(2, 4)
    assert index.propose([a, b, x, c, a, b, y, d, a, b], 2) == [y, d]  # the most recent "a b"
    index = NgramIndex(2, 4)
    # "c a b" (n=3) occurred once, followed by x; "a b" alone last occurred before y: longest wins.
    assert index.propose([c, a, b, x, d, a, b, y, c, a, b], 1) == [x]
    assert NgramIndex(2, 4).propose([a, b, c], 3) == []


def test_ngram_draft_of_a_repeating_text_goes_on_repeating():
    """A match that ends just before the end leaves fewer than k tokens after it: the draft reads on
    into itself (greedy loops of period 1 or 2 got 1- or 2-token drafts where 3 were asked for)."""
    a, b, c = 1, 2, 3
    assert NgramIndex(2, 4).propose([c, a, b, a, b], 3) == [a, b, a]
    assert NgramIndex(2, 4).propose([c, a, a, a], 3) == [a, a, a]
    assert NgramIndex(2, 4).propose([c, a, b, c, a, b], 5) == [c, a, b, c, a]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2))
def test_ngram_index_kept_as_tokens_arrive_equals_a_fresh_scan(tokens, k, ngram_min, extra):
    ngram_max = ngram_min + extra
    index = NgramIndex(ngram_min, ngram_max)
    for end in range(1, len(tokens) + 1):  # proposed after every token, as decoding does
        assert index.propose(tokens[:end], k) == brute_force_proposal(tokens[:end], k, ngram_min, ngram_max)


def test_policy_drafts_more_when_drafts_are_accepted_and_none_when_they_never_are():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=5))
    assert speculator.step_cost(1, 1, 3) == pytest.approx(1.3)  # untimed rows: cheap, so that they get tried
    assert speculator.choose_k(0.0) == 0
    assert speculator.choose_k(0.05) == 0
    assert 1 <= speculator.choose_k(0.5) < speculator.choose_k(0.95) == 5
    assert speculator.choose_k(0.95, limit=2) == 2
    for rows in range(1, 7):  # timed: each draft row costs a whole step, never worth it
        speculator.observe_step(1, rows, 0.01 * rows)
    assert speculator.choose_k(0.9) == 0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_policy_follows_the_timed_cost_of_each_row_count():
    """A step's time is not linear in its rows: where 2 rows cost what 1 does and more cost much
    more, a weak source gets one draft; in a batch, the extra rows cost less of the step."""
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=5))
    for rows, ms in [(1, 10), (2, 10), (3, 14), (4, 15), (5, 16), (6, 17)]:
        speculator.observe_step(1, rows, ms / 1000)
    assert speculator.step_cost(1, 1, 1) == pytest.approx(1.0)
    assert speculator.choose_k(0.2) == 1
    assert speculator.choose_k(0.9) == 5
    for rows, ms in [(4, 30), (5, 30.5), (6, 40)]:
        speculator.observe_step(4, rows, ms / 1000)
    assert speculator.step_cost(4, 4, 1) == pytest.approx(30.5 / 30)
    assert speculator.choose_k(0.2, num_requests=4) == 1
    assert speculator.choose_k(0.2, num_requests=4, limit=0) == 0
    # The second request of that step, after the first took its free row: one more costs 40 / 30.5.
    assert speculator.choose_k(0.2, num_requests=4, rows=5, tokens=4.2) == 0


def test_policy_counts_the_drafts_of_the_requests_before_in_the_step():
    """Each request's k is judged against the step as the requests before it left it: four
    requests that could each take 5 drafts at the cost of a lone request's rows do not all get
    them when 4 + 20 rows cost what they do."""
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=5))
    for rows in range(4, 25):  # 4 decodes: 4-8 rows cost the same, then each row 10% of the step
        speculator.observe_step(4, rows, 1.0 + 0.1 * max(0, rows - 8))
    a, b, c, d, x = range(1, 6)
    requests = [FakeRequest([a, b, c, d, x, a, b, c, d]) for _ in range(4)]
    speculator.begin_step(4)
    lengths = [len(speculator.propose(r, 5)) for r in requests]
    assert lengths[0] == 4 and sum(lengths) < 20, lengths


class FakeRequest:
    def __init__(self, tokens, grammar=None, temperature=0.8):
        self.all_token_ids = tokens
        self.grammar = grammar
        self.draft_state = None
        self.params = SamplingParams(temperature=temperature)


def test_policy_drafts_longer_after_longer_matches_and_learns_each_source_rate():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=5))
    for rows in range(1, 7):  # a row costs 15% of the step
        speculator.observe_step(1, rows, 1 + 0.15 * (rows - 1))
    a, b, c, d, x = range(1, 6)
    long_match = FakeRequest([a, b, c, d, x, a, b, c, d])  # "a b c d" again: a match of 4
    short_match = FakeRequest([a, b, c, d, x, d])  # "d" again: a match of 1

    def propose(request):  # a step of its own
        speculator.begin_step(1)
        return speculator.propose(request, 5)

    assert propose(long_match) == [x, a, b, c, d]
    assert propose(short_match) == []  # ~15% right: not worth a row at this cost
    # Matches of 4 keep failing for this request: it drafts less, and the engine's rate moves too.
    lengths = []
    while drafts := propose(long_match):
        lengths.append(len(drafts))
        speculator.record(long_match, len(drafts), 0)
        assert len(lengths) < 20
    assert lengths[0] == 5 and lengths[-1] < 5 and lengths == sorted(lengths, reverse=True)
    assert long_match.draft_state.acceptance[4] < 0.2
    assert speculator.acceptance[False, 4] < 0.8  # the engine's rate for sampled requests
    assert speculator.acceptance[True, 4] == 0.85  # greedy ones: not what sampled ones found
    fresh = FakeRequest([a, b, c, d, x, a, b, c, d])
    assert propose(fresh)  # a new request starts from the engine's rate, still above what pays


# ------------------------------------------------------------------------------ verification

VOCAB = 12
EOS = 0


class SyntheticModel:
    """Logits of the next token from the last two tokens of the context: a fixed random table."""

    def __init__(self, seed=0, scale=2.0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn((VOCAB, VOCAB, VOCAB), generator=g) * scale

    def logits(self, context):
        return self.table[context[-2], context[-1]]


def request(params, prompt, output, drafts=(), generator=None):
    return ScheduledRequest(
        request_id="r",
        token_ids=[],
        start_position=0,
        block_tables=[[]],
        samples=True,
        params=params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        generator=generator,
        draft_token_ids=list(drafts),
    )


def step(model, params, prompt, output, drafts, generator):
    """One verification step: the rows' logits as the model gives them, then the sampler."""
    context = list(prompt) + list(output)
    rows = [model.logits(context + list(drafts[:j])) for j in range(len(drafts) + 1)]
    result = sample_requests(torch.stack(rows), [request(params, prompt, output, drafts, generator)], (EOS,))
    return result.sampled["r"], result.logprobs["r"]


PARAMS = [
    SamplingParams(max_tokens=64, temperature=0),
    SamplingParams(max_tokens=64, temperature=1.0, logprobs=3),
    SamplingParams(max_tokens=64, temperature=0.7, top_k=5, top_p=0.9, logprobs=2),
    SamplingParams(max_tokens=64, temperature=1.3, min_p=0.05),
    SamplingParams(max_tokens=64, temperature=1.0, presence_penalty=1.5, frequency_penalty=0.7, logprobs=1),
    SamplingParams(max_tokens=64, temperature=0.9, repetition_penalty=1.8),
    SamplingParams(max_tokens=64, temperature=1.0, min_tokens=6, logit_bias={3: 4.0, 5: -100.0}, logprobs=0),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_seeded_verification_gives_the_tokens_logprobs_and_draws_of_decoding_without_drafts(params):
    model = SyntheticModel()
    prompt = [1, 2, 3, 4, 1, 2]
    rng = random.Random(0)
    for seed in range(8):
        # Decoding without drafts: the reference tokens, logprobs and the generator after each.
        reference, reference_logprobs, states = [], [], []
        generator = torch.Generator().manual_seed(seed)
        for _ in range(24):
            run, logprobs = step(model, params, prompt, reference, [], generator)
            reference += run
            reference_logprobs += logprobs
            states.append(generator.get_state())
        # With drafts: likely ones (the reference itself), unlikely ones, forbidden ones (EOS
        # under min_tokens, token 5 under logit_bias -100), of random lengths.
        output, logprobs = [], []
        generator = torch.Generator().manual_seed(seed)
        while len(output) < 20:
            k = rng.randint(0, 4)
            drafts = list(reference[len(output) : len(output) + k])
            for j in range(len(drafts)):
                if rng.random() < 0.3:
                    drafts[j] = rng.choice([EOS, 5, rng.randrange(VOCAB)])
            run, run_logprobs = step(model, params, prompt, output, drafts, generator)
            assert 1 <= len(run) <= len(drafts) + 1 and run[:-1] == drafts[: len(run) - 1]
            output += run
            logprobs += run_logprobs
            assert output == reference[: len(output)]
            assert torch.equal(generator.get_state(), states[len(output) - 1])
        assert logprobs == reference_logprobs[: len(output)]


def chi_square_p_value(counts_a, counts_b):
    """Two-sample chi-square test of homogeneity over the cells either sample saw."""
    cells = sorted(set(counts_a) | set(counts_b))
    n_a, n_b = sum(counts_a.values()), sum(counts_b.values())
    statistic = 0.0
    for cell in cells:
        a, b = counts_a.get(cell, 0), counts_b.get(cell, 0)
        total = a + b
        for observed, n in ((a, n_a), (b, n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (observed - expected) ** 2 / expected
    df = len(cells) - 1
    return torch.special.gammaincc(
        torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
    ).item()


def first_tokens(model, params, prompt, drafts, num_samples, seed):
    """How often each (t0, t1) starts the output: one speculative step then, if it yielded one
    token only, one more step without drafts."""
    torch.manual_seed(seed)  # unseeded requests draw from torch's default generator
    counts = {}
    for _ in range(num_samples):
        output, _ = step(model, params, prompt, [], drafts, None)
        if len(output) < 2:
            output += step(model, params, prompt, output, [], None)[0]
        counts[tuple(output[:2])] = counts.get(tuple(output[:2]), 0) + 1
    return counts


DISTRIBUTION_PARAMS = SamplingParams(
    max_tokens=64, temperature=0.8, top_p=0.95, presence_penalty=2.0, logit_bias={4: 1.5}
)


def test_unseeded_outputs_with_drafts_are_distributed_as_without():
    model = SyntheticModel(seed=3, scale=0.6)
    prompt = [7, 8, 9]
    base = first_tokens(model, DISTRIBUTION_PARAMS, prompt, [], 3000, seed=1)
    likely = max(range(VOCAB), key=lambda t: model.logits(prompt)[t].item())
    for drafts in ([likely, likely], [likely, 11], [11, 2]):
        spec = first_tokens(model, DISTRIBUTION_PARAMS, prompt, drafts, 3000, seed=2)
        assert chi_square_p_value(base, spec) > 1e-4, drafts


def test_a_verifier_that_forgets_the_drafts_in_the_penalties_fails_the_distribution_test(monkeypatch):
    """The check above has teeth: a verifier that samples row j without drafts 0..j-1 in the
    request's output (so presence_penalty misses them) is caught."""
    real = verification.SamplingBatch.from_params

    def forgetful(params, prompts, outputs, *args, **kwargs):
        outputs = [o[: len(outputs[0])] for o in outputs]  # every row sees only the emitted output
        return real(params, prompts, outputs, *args, **kwargs)

    model = SyntheticModel(seed=3, scale=0.6)
    prompt = [7, 8, 9]
    base = first_tokens(model, DISTRIBUTION_PARAMS, prompt, [], 3000, seed=1)
    likely = max(range(VOCAB), key=lambda t: model.logits(prompt)[t].item())
    monkeypatch.setattr(verification.SamplingBatch, "from_params", forgetful)
    spec = first_tokens(model, DISTRIBUTION_PARAMS, prompt, [likely, likely], 3000, seed=2)
    assert chi_square_p_value(base, spec) < 1e-4


# ------------------------------------------------------------------- the scheduler with drafts


class OracleProposer:
    """Drafts from the fake model's reference output, some of them wrong on purpose."""

    def __init__(self, seed=0, wrong=0.3):
        self.rng = random.Random(seed)
        self.wrong = wrong
        self.proposed = []  # (request id, num_tokens, drafts)

    def __call__(self, request, limit):
        from tests.engine.test_scheduler import VOCAB as FAKE_VOCAB, reference_output

        k = min(self.rng.randint(0, 4), limit)
        if k <= 0:
            return []
        full = reference_output(request.prompt_token_ids, request.num_output_tokens + k)
        drafts = full[request.num_output_tokens :]
        drafts = [self.rng.randrange(1, FAKE_VOCAB) if self.rng.random() < self.wrong else t for t in drafts]
        self.proposed.append((request.request_id, request.num_tokens, drafts))
        return drafts


def speculating_scheduler(**kw):
    from tests.engine.test_scheduler import make_scheduler

    s = make_scheduler(speculative=SpeculativeConfig(num_speculative_tokens=4, max_batch_size=64), **kw)
    proposer = OracleProposer()
    s.speculator.propose = proposer
    return s, proposer


@pytest.mark.parametrize("num_blocks", [64, 12])  # 12: preemptions, drafts dropped for blocks first
def test_scheduler_with_drafts_gives_the_reference_outputs_and_a_clean_pool(num_blocks):
    from tests.engine.test_scheduler import FakePagedModel, add, reference_output, run

    s, proposer = speculating_scheduler(num_blocks=num_blocks, max_num_batched_tokens=64, max_num_seqs=8)
    model = FakePagedModel(4)
    reqs = [add(s, f"r{i}", range(i * 11, i * 11 + 6), max_tokens=5 + i % 11) for i in range(10)]
    steps = run(s, model)  # audits the pool after every step
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.params.max_tokens)
        assert r.status is RequestStatus.FINISHED_LENGTH
    assert s.speculator.stats.num_accepted_tokens > 0
    assert s.speculator.stats.num_draft_tokens > s.speculator.stats.num_accepted_tokens
    assert model.num_computed_tokens == sum(o.num_batched_tokens for o in steps)
    if num_blocks == 12:
        assert s.num_preemptions > 0 or s.speculator.stats.num_cut_by_budget > 0
    # Drafts never ask for more than max_tokens or the context allows.
    for rid, num_tokens, drafts in proposer.proposed:
        r = next(r for r in reqs if r.request_id == rid)
        assert num_tokens - r.num_prompt_tokens + len(drafts) + 1 <= r.params.max_tokens


def test_no_cached_block_holds_a_rejected_draft():
    """Every prompt again, extended by its output: the prefix cache serves their blocks, and
    the fake model reads its context back through them, so a block whose KV came from a
    rejected draft would change the outputs."""
    from tests.engine.test_scheduler import FakePagedModel, add, reference_output, run

    s, _ = speculating_scheduler(num_blocks=256, max_num_batched_tokens=64, max_num_seqs=8)
    model = FakePagedModel(4)
    first = [add(s, f"a{i}", range(i * 13, i * 13 + 7), max_tokens=21) for i in range(6)]
    run(s, model)
    again = [add(s, f"b{i}", r.prompt_token_ids + r.output_token_ids, max_tokens=6) for i, r in enumerate(first)]
    run(s, model)
    for r in again:
        assert r.num_cached_tokens >= 24
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 6)


def test_a_stop_inside_an_accepted_run_drops_what_follows():
    from tests.engine.test_scheduler import FakePagedModel, add, reference_output, run

    s, _ = speculating_scheduler(num_blocks=64, max_num_batched_tokens=64)
    s.speculator.propose.wrong = 0.0  # every draft right: runs of up to 5 tokens
    model = FakePagedModel(4)
    prompt = list(range(40, 46))
    expected = reference_output(prompt, 30)
    stop_at = 7
    r = add(s, "r", prompt, max_tokens=30, stop_token_ids=(expected[stop_at],))
    run(s, model)
    first = expected.index(expected[stop_at])
    assert r.output_token_ids == expected[: first + 1]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == expected[stop_at]
