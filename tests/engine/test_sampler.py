"""The sampler against hand-computed distributions on a 5-token vocabulary."""

import math

import pytest
import torch

from engine.request import GREEDY_TEMPERATURE, SamplingParams
from engine.sampler import SamplingBatch, greedy_argmax, make_generator, process_logits, sample, sampling_probs

# A 5-token distribution with no ties: p = [0.1, 0.3, 0.05, 0.4, 0.15].
PROBS = [0.1, 0.3, 0.05, 0.4, 0.15]
LOGITS = torch.tensor([PROBS]).log()


def batch_of(params, outputs=None, prompts=None, generators=None, vocab_size=5, **kwargs):
    n = len(params)
    return SamplingBatch.from_params(
        params,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        generators or [None] * n,
        vocab_size,
        "cpu",
        **kwargs,
    )


def probs_for(params, logits=LOGITS, **kwargs):
    batch = batch_of([params], **kwargs)
    return sampling_probs(process_logits(logits, batch), batch)[0]


def expected(weights):  # dict token -> unnormalised weight -> 5-vector of probabilities
    total = sum(weights.values())
    return torch.tensor([weights.get(t, 0.0) / total for t in range(5)])


def test_greedy_rows_take_argmax_even_beside_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=40)] * 3
    out = sample(logits, batch_of(params, vocab_size=50))
    assert out.token_ids[0::2] == logits[0::2].argmax(-1).tolist()
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("temperature", [0.0, GREEDY_TEMPERATURE / 2, GREEDY_TEMPERATURE, 0.7])
def test_sampling_params_greedy_is_what_the_sampler_does(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.greedy == (temperature < GREEDY_TEMPERATURE)
    assert batch_of([params]).all_greedy == params.greedy


@pytest.mark.parametrize("vocab_size", [49152, 1000, 200])  # blocked, not a multiple of the block, too small
def test_greedy_argmax_is_torch_argmax_with_ties_infinities_and_nan(vocab_size):
    torch.manual_seed(0)
    cases = [
        torch.randn(8, vocab_size),
        torch.randint(-3, 3, (8, vocab_size)).float(),  # many ties
        torch.full((8, vocab_size), 1.0),
        torch.full((8, vocab_size), float("-inf")),
    ]
    cases[3][2, vocab_size - 1] = 0.0
    nan = torch.randn(8, vocab_size)
    nan[1, vocab_size // 2], nan[1, 3] = float("nan"), float("nan")
    for logits in cases + [nan]:
        assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))


def test_all_greedy_batch_without_edits_samples_without_copying_logits():
    logits = torch.randn(4, 256)
    batch = batch_of([SamplingParams(temperature=0.0)] * 4, vocab_size=256)
    assert process_logits(logits, batch).data_ptr() == logits.data_ptr()
    assert sample(logits, batch).token_ids == logits.argmax(-1).tolist()


def test_sample_leaves_the_callers_logits_untouched():
    logits = torch.randn(2, 5)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.3, logit_bias={1: 2.0}, top_p=0.5), SamplingParams(min_p=0.2)]
    sample(logits, batch_of(params, outputs=[[1, 2], [3]]))
    assert torch.equal(logits, before)


def test_top_k_keeps_the_k_best_renormalised():
    assert torch.allclose(probs_for(SamplingParams(top_k=2)), expected({3: 0.4, 1: 0.3}), atol=1e-6)
    assert torch.allclose(probs_for(SamplingParams(top_k=0)), torch.tensor(PROBS), atol=1e-6)
    assert torch.allclose(probs_for(SamplingParams(top_k=-1)), torch.tensor(PROBS), atol=1e-6)
    assert torch.allclose(probs_for(SamplingParams(top_k=99)), torch.tensor(PROBS), atol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # Best first: 0.4, 0.3, 0.15, 0.1, 0.05; mass before each: 0, 0.4, 0.7, 0.85, 0.95.
    assert torch.allclose(probs_for(SamplingParams(top_p=0.75)), expected({3: 0.4, 1: 0.3, 4: 0.15}), atol=1e-6)
    assert torch.allclose(probs_for(SamplingParams(top_p=0.6)), expected({3: 0.4, 1: 0.3}), atol=1e-6)
    assert torch.allclose(probs_for(SamplingParams(top_p=0.01)), expected({3: 1.0}), atol=1e-6)


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # Threshold = min_p * 0.4.
    assert torch.allclose(probs_for(SamplingParams(min_p=0.5)), expected({3: 0.4, 1: 0.3}), atol=1e-6)
    assert torch.allclose(probs_for(SamplingParams(min_p=0.3)), expected({3: 0.4, 1: 0.3, 4: 0.15}), atol=1e-6)


def test_temperature_then_top_k_then_top_p():
    # T = 0.5 squares the probabilities: 0.01, 0.09, 0.0025, 0.16, 0.0225 (sum 0.285).
    assert torch.allclose(
        probs_for(SamplingParams(temperature=0.5)),
        expected({0: 0.01, 1: 0.09, 2: 0.0025, 3: 0.16, 4: 0.0225}),
        atol=1e-6,
    )
    # top_k=3 keeps .16, .09, .0225 -> .587, .330, .083; top_p=0.9: mass before 0, .587, .917 -> two stay.
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9)
    assert torch.allclose(probs_for(params), expected({3: 0.16, 1: 0.09}), atol=1e-6)


@pytest.fixture(params=["kernel draw", "torch draw"])
def draw_path(request, monkeypatch):
    """Both ways a row is drawn: one op of ours on CPU (cpu_kernels.draw_rows), or torch's ops (_draw
    on sampling_probs: other devices, no compiler)."""
    if request.param == "torch draw":
        from engine import sampler

        monkeypatch.setattr(sampler.cpu_kernels, "usable", lambda x: False)
    return request.param


def test_draws_follow_the_processed_distribution(draw_path):
    rows = 20000
    params = [SamplingParams(temperature=0.5, top_k=3)] * rows
    gen = torch.Generator().manual_seed(1234)
    out = sample(LOGITS.expand(rows, 5), batch_of(params, default_generator=gen))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=5) / rows
    want = expected({3: 0.16, 1: 0.09, 4: 0.0225})
    assert freq[0] == freq[2] == 0
    assert torch.allclose(freq, want, atol=0.015), (freq, want)


def run_seeded(seed, step_logits, companions):
    """Tokens of one seeded request over the steps, batched each step with `companions(step)`."""
    target = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5, seed=seed)
    gen = make_generator(seed, "cpu")
    outputs: list[int] = []
    for step, row_logits in enumerate(step_logits):
        others = companions(step)
        position = step % (len(others) + 1)
        params = [p for p, _, _ in others]
        params.insert(position, target)
        logits = [lg for _, lg, _ in others]
        logits.insert(position, row_logits)
        gens = [g for _, _, g in others]
        gens.insert(position, gen)
        outs = [[1, 2, 3]] * len(others)
        outs.insert(position, list(outputs))
        batch = SamplingBatch.from_params(params, [[0, 1]] * len(params), outs, gens, row_logits.numel(), "cpu")
        outputs.append(sample(torch.stack(logits), batch).token_ids[position])
    return outputs


def test_seeded_request_is_reproducible_whatever_its_batch():
    vocab = 700
    torch.manual_seed(7)
    # Peaked steps find the top-p nucleus among the candidates, flat ones need the full sort.
    step_logits = [torch.randn(vocab) * (4.0 if step % 2 else 0.3) for step in range(40)]
    alone = run_seeded(42, step_logits, lambda step: [])
    rng = torch.Generator().manual_seed(99)

    def crowd(step):
        kinds = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.3, top_k=5, seed=3),
            SamplingParams(temperature=0.7, min_p=0.1),
            SamplingParams(repetition_penalty=1.5, logprobs=3),
            SamplingParams(top_k=400, top_p=0.5),
        ]  # widens the candidate set of the whole batch
        count = int(torch.randint(1, 6, (1,), generator=rng))
        picks = torch.randint(0, len(kinds), (count,), generator=rng).tolist()
        return [(kinds[k], torch.randn(vocab, generator=rng) * 3, make_generator(kinds[k].seed, "cpu")) for k in picks]

    assert run_seeded(42, step_logits, crowd) == alone
    assert run_seeded(43, step_logits, lambda step: []) != alone  # the seed does matter


def reference_probs(logits, temperature, top_k, top_p, min_p):
    """Straightforward float64 version: full sort, top-k, then top-p on the renormalised rest."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = top_k if top_k > 0 else len(probs)
    kept = order[:k]
    cum = torch.cumsum(probs[kept] / probs[kept].sum(), 0)
    num = int((cum - probs[kept] / probs[kept].sum() < top_p).sum())
    keep[kept[:num]] = True
    filtered = torch.where(keep, probs, 0.0)
    filtered = torch.where(filtered >= filtered.max() * min_p, filtered, 0.0)
    return filtered / filtered.sum()


def test_filters_match_a_full_sort_reference_on_every_path():
    torch.manual_seed(11)
    vocab = 5000
    cases = [
        (1.0, 0, 0.9, 0.0),
        (1.0, 0, 0.3, 0.0),
        (0.7, 50, 0.8, 0.0),
        (1.2, 600, 0.95, 0.0),
        (1.0, 0, 0.99, 0.05),
        (0.5, 3, 1.0, 0.0),
        (2.0, 0, 0.5, 0.0),
        (1.0, 300, 1.0, 0.2),
    ]
    scales = [0.2, 3.0]  # flat rows: nucleus wider than the candidates; peaked: inside them
    params, logits, refs = [], [], []
    for t, k, p, m in cases:
        for scale in scales:
            row = torch.randn(vocab) * scale
            params.append(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m))
            logits.append(row)
            refs.append(reference_probs(row, t, k, p, m))
    batch = batch_of(params, vocab_size=vocab)
    got = sampling_probs(process_logits(torch.stack(logits), batch), batch)
    for i, ref in enumerate(refs):
        assert torch.equal(got[i] > 0, ref > 0), (params[i], int((got[i] > 0).sum()), int((ref > 0).sum()))
        assert torch.allclose(got[i].double(), ref, atol=1e-6)
    # Flat top-p rows: one nucleus needed the 4096 best, the other the full sort.
    assert 256 < int((got[2] > 0).sum()) < 4096 and int((got[0] > 0).sum()) > 4096


def test_top_k_and_top_p_keep_tokens_tied_with_the_last_kept():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    assert torch.allclose(probs_for(SamplingParams(top_k=2), logits), expected({1: 1, 2: 1, 4: 1}), atol=1e-6)
    assert torch.allclose(probs_for(SamplingParams(top_p=0.1), logits), expected({1: 1, 2: 1, 4: 1}), atol=1e-6)


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    batch = batch_of([SamplingParams(repetition_penalty=2.0)], prompts=[[0]], outputs=[[1, 3, 3]])
    assert process_logits(logits, batch).tolist() == [[1.0, -2.0, 0.5, 1.5, -2.0]]


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    batch = batch_of([params], prompts=[[0, 2]], outputs=[[1, 3, 3]])
    # token 1: -1 - 0.5 - 0.25; token 3: 3 - 2 * 0.5 - 0.25; prompt tokens 0 and 2 untouched.
    assert process_logits(logits, batch).tolist() == [[2.0, -1.75, 0.5, 1.75, -2.0]]


def test_penalties_compose_with_logit_bias_first():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(
        repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={2: 5.0, 1: 2.0}
    )
    batch = batch_of([params], prompts=[[0]], outputs=[[1, 3, 3]])
    # bias: token 1 -> 1.0, token 2 -> 5.5; repetition on 0, 1, 3: 1.0, 0.5, 1.5; then counts on 1 and 3.
    assert process_logits(logits, batch).tolist() == [[1.0, -0.25, 5.5, 0.25, -2.0]]


def test_neutral_params_build_no_penalty_or_filter_tensors():
    batch = batch_of([SamplingParams(), SamplingParams(temperature=0.0)], outputs=[[1], [2]])
    assert batch.repetition is None and batch.counts is None and batch.logit_bias is None
    assert batch.temperature is None and batch.top_k_top_p is None and batch.min_p is None and batch.banned is None
    all_greedy = batch_of([SamplingParams(temperature=0.0, top_k=2)])
    assert all_greedy.all_greedy and all_greedy.temperature is None and all_greedy.top_k_top_p is None


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0, 8.0]] * 4)  # EOS (3) is the argmax, stop token 4 next
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(4,))] * 3
    params.append(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True))
    outputs = [[], [1], [1, 1], [1]]
    out = sample(logits, batch_of(params, outputs=outputs, eos_token_ids=[3]))
    assert out.token_ids[:3] != [3, 3, 3] and out.token_ids[0] not in (3, 4) and out.token_ids[1] not in (3, 4)
    assert out.token_ids[2] == 3  # min_tokens reached
    assert out.token_ids[3] == 3  # ignore_eos: EOS is an ordinary token, nothing to mask
    per_row = batch_of(params[:2], outputs=outputs[:2], eos_token_ids=[[3], [2]])
    assert process_logits(logits[:2], per_row)[1].tolist() == [0.0, 0.0, float("-inf"), 9.0, float("-inf")]


def test_logprobs_are_log_softmax_after_penalties_before_temperature():
    torch.manual_seed(3)
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(temperature=0.3, top_k=4, logprobs=5, logit_bias={7: 3.0}),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.9),
    ]
    out = sample(logits, batch_of(params, vocab_size=30))
    biased = logits[0].clone()
    biased[7] += 3.0
    reference = torch.log_softmax(biased, -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, reference[first.token_id].item(), abs_tol=1e-6)
    assert [t for t, _ in first.top] == reference.topk(5).indices.tolist()
    assert all(math.isclose(lp, reference[t].item(), abs_tol=1e-6) for t, lp in first.top)
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)
    assert out.logprobs[1].top == [] and out.logprobs[1].token_id == logits[1].argmax().item()
    assert math.isclose(out.logprobs[1].logprob, torch.log_softmax(logits[1], -1).max().item(), abs_tol=1e-6)
    assert out.logprobs[2] is None


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="logit_bias"):
        batch_of([SamplingParams(logit_bias={5: 1.0})])
    with pytest.raises(ValueError, match="shape"):
        sample(torch.zeros(2, 5), batch_of([SamplingParams()]))
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.from_params([SamplingParams()], [], [[]], [None], 5, "cpu")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1e-88),  # 0 in float32: seen / 0 = inf, -inf * 0 = nan
        SamplingParams(repetition_penalty=1e-88, top_p=0.5, top_k=3),
        SamplingParams(repetition_penalty=1e-88, temperature=0.0),
        SamplingParams(repetition_penalty=1e30, min_p=0.5),
        SamplingParams(top_p=1e-300),  # 0 in float32: no token reaches it
        SamplingParams(top_p=1e-300, top_k=2),
        SamplingParams(logit_bias={0: float("inf"), 1: float("nan")}),
        SamplingParams(logit_bias={t: float("-inf") for t in range(5)}),  # nothing left to sample
        SamplingParams(temperature=1e-4, repetition_penalty=1e-30),
    ],
)
def test_hostile_params_never_give_a_token_outside_the_vocabulary(params, draw_path):
    torch.manual_seed(0)
    logits = LOGITS.repeat(3, 1)
    logits[1, 4] = float("-inf")
    for _ in range(20):
        batch = batch_of([params] * 3, prompts=[[0, 1, 4]] * 3, outputs=[[3, 3]] * 3, eos_token_ids=[4])
        assert all(0 <= t < 5 for t in sample(logits, batch).token_ids)


def test_tiny_top_p_keeps_the_best_token(draw_path):
    out = sample(LOGITS.repeat(4, 1), batch_of([SamplingParams(top_p=1e-300)] * 4))
    assert out.token_ids == [3] * 4


def test_penalty_tensors_grow_by_the_new_tokens_only_and_match_a_full_recount():
    """A request's TokenHistory takes each token in once across steps (no rebuild from the
    whole context), and the penalised logits equal a per-step recount of prompt and output."""
    from collections import Counter

    from engine.sampler import TokenHistory

    vocab_size, rng = 50, torch.Generator().manual_seed(0)
    params = [
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(frequency_penalty=-0.75),
        SamplingParams(repetition_penalty=0.8),
    ]
    prompts = [torch.randint(0, vocab_size, (n,), generator=rng).tolist() for n in (40, 1, 7)]
    outputs = [[], [], []]
    histories = [TokenHistory("cpu") for _ in params]
    for _ in range(30):
        logits = torch.randn(3, vocab_size, generator=rng)
        batch = SamplingBatch.from_params(params, prompts, outputs, [None] * 3, vocab_size, "cpu", histories=histories)
        want = logits.clone()
        for row, p in enumerate(params):
            for t in set(prompts[row]) | set(outputs[row]):
                x = want[row, t]
                want[row, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            for t, n in Counter(outputs[row]).items():
                want[row, t] -= p.presence_penalty + p.frequency_penalty * n
        torch.testing.assert_close(process_logits(logits, batch), want)
        for row in range(3):
            outputs[row].append(int(torch.randint(0, 8, (1,), generator=rng)))  # repeats are the point
    for history, prompt, output in zip(histories, prompts, outputs):
        history.update(prompt, output)
        assert history.num_tokens_added == len(prompt) + len(output)  # each token once, never rebuilt


def test_a_long_rows_nucleus_is_the_same_alone_in_a_batch_and_on_either_thread_count():
    """SmolLM2's 49152 logits: torch splits a .sum() of one such row across 2 threads (and not
    when the row is in a batch), so its rounding would follow the thread count and the batch.
    top_p is put where the last bits of the top-k mass decide the nucleus's edge."""
    vocab = 49152
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 2
    top_k = vocab - 1  # top-k and top-p together: top-p renormalises over the mass top-k kept
    ordered = logits[0].softmax(-1).sort(descending=True).values
    kept = ordered[:top_k].sum()
    before = torch.get_num_threads()
    try:
        for rank in (10, 60, 200):
            edge = (ordered[:rank].sum() / kept).item()
            for step in range(-4, 5):
                params = SamplingParams(top_k=top_k, top_p=edge * (1 + step * 6e-8))
                seen = []
                for threads, rows in ((1, 1), (2, 1), (2, 4)):
                    torch.set_num_threads(threads)
                    batch = batch_of([params] * rows, vocab_size=vocab)
                    seen.append(sampling_probs(process_logits(logits[:rows], batch), batch)[0])
                assert torch.equal(seen[0], seen[1]) and torch.equal(seen[0], seen[2]), (rank, step)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.8),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=50),
        dict(temperature=0.8, top_k=40, top_p=0.95),
        dict(temperature=1.3, top_p=0.5),
        dict(temperature=0.8, top_k=1),
        dict(temperature=0.8, top_k=49152),
        dict(temperature=0.8, min_p=0.05),
        dict(temperature=0.9, top_k=100, top_p=0.9, min_p=0.1),
    ],
)
def test_the_cpu_kernels_draw_is_the_torch_draw(kw):
    # On CPU with our kernels a row's draw is one op (cpu_kernels.draw_rows: temperature, top-k,
    # top-p and min-p inside, the vocabulary never sorted); the torch ops (_draw on sampling_probs) are the
    # reference. For the same uniforms they take the same token, but where one falls within
    # rounding of a boundary between two tokens (float32 sums in another order).
    from engine import sampler
    from models.layers import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU kernels")
    gen = torch.Generator().manual_seed(5)
    vocab = 49152
    rows = [torch.randn(vocab, generator=gen) * scale for scale in (1.0, 3.0, 8.0)]  # flat to peaked
    rows[1][::7] = float("-inf")  # forbidden tokens
    logits = torch.stack(rows * 4)  # (12, V)
    batch = batch_of(
        [SamplingParams(seed=0, **kw)] * 12,
        generators=[torch.Generator().manual_seed(i) for i in range(12)],
        vocab_size=vocab,
    )
    forbidden = torch.isinf(sampler.sampling_logits(logits, batch))  # what temperature, top-k and top-p cut
    agree = total = 0
    for u in torch.linspace(0, 0.999, 150):
        uniforms = torch.full((12,), float(u))
        ours = cpu_kernels.draw_rows(logits, *sampler.draw_knobs(batch, uniforms))
        cdf = sampler.sampling_probs(logits, batch).double().cumsum(-1)
        theirs = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1])[:, None], right=True).squeeze(1)
        assert not forbidden.gather(1, ours[:, None]).any()  # never a token the cut removed
        agree += int((ours == theirs).sum())
        total += 12
    assert agree >= 0.995 * total, (agree, total)
