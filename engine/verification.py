"""Sampling a step's rows and verifying drafts against them (engine/speculative.py proposes them).

A request with k drafts has k + 1 rows; row j is sampled as if drafts 0..j-1 had been emitted
(its output, penalties, min_tokens and grammar mask include them), and the request keeps the
tokens up to and including the first that differs from its draft:

    drafts      d0  d1  d2
    rows        r0  r1  r2  r3        sampled: r0 == d0, r1 == d1, r2 != d2
    kept        d0  d1  r2            (r3 is never looked at)

The rule this relies on: the sampler draws exactly one uniform per random row, in row order,
from the row's generator (engine/sampling/draw.py), and none for greedy rows. So a seeded
request's generator, rewound after the step and advanced once per kept token, stands where
decoding without drafts would have left it, and its later tokens do not depend on drafts.
"""

from __future__ import annotations

import torch

from collections.abc import Sequence

from engine.sampler import SamplingBatch, sample
from engine.step import RunnerOutput, ScheduledRequest
from engine.structured import allowed_tokens


def sample_requests(
    logits: torch.Tensor, requests: list[ScheduledRequest], eos_token_ids: Sequence[int] | Sequence[Sequence[int]] = ()
) -> RunnerOutput:
    """Sample every row, then verify drafts (engine/speculative.py): a request with k drafts
    has k + 1 rows, row j sampled as if drafts 0..j-1 had been emitted (its output, penalties,
    min_tokens and grammar mask include them; its generator draws in row order), and keeps
    the tokens up to and including the first that differs from its draft."""
    params, outputs, histories, generators, prompts = [], [], [], [], []
    for s in requests:
        for j in range(1 + len(s.draft_token_ids)):
            params.append(s.params)
            prompts.append(s.prompt_token_ids)
            outputs.append(s.output_token_ids + s.draft_token_ids[:j] if j else s.output_token_ids)
            histories.append(s.token_history if j == 0 else None)  # the cache follows emitted tokens only
            generators.append(s.generator)
    vocab_size = logits.shape[-1]
    allowed = None
    constrained = [s for s in requests if s.grammar is not None]
    if constrained:
        constrained_rows: list[int] = []
        row = 0
        for s in requests:
            if s.grammar is not None:
                constrained_rows += range(row, row + 1 + len(s.draft_token_ids))
            row += 1 + len(s.draft_token_ids)
        masks = allowed_tokens(
            [s.grammar for s in requests if s.grammar is not None], vocab_size, [s.draft_token_ids for s in constrained]
        )
        allowed = (torch.tensor(constrained_rows, dtype=torch.int64, device=logits.device), masks.to(logits.device))
    batch = SamplingBatch.from_params(
        params,
        prompts,
        outputs,
        generators,
        vocab_size=vocab_size,
        device=logits.device,
        eos_token_ids=eos_token_ids,
        histories=histories,
        allowed=allowed,
    )
    drafted = [s for s in requests if s.draft_token_ids and s.generator is not None and not s.params.greedy]
    states = {s.request_id: s.generator.get_state() for s in drafted if s.generator is not None}
    out = sample(logits, batch)
    request_ids = [s.request_id for s in requests for _ in range(1 + len(s.draft_token_ids))]
    bad = [(rid, t) for rid, t in zip(request_ids, out.token_ids) if not 0 <= t < vocab_size]
    if bad:  # fed back into the next forward, it would fail the whole batch there
        raise ValueError(f"sampled token ids {bad} are outside the vocabulary (size {vocab_size})")
    result, row = RunnerOutput(), 0
    for s in requests:
        drafts = s.draft_token_ids
        run = []
        for j, token_id in enumerate(out.token_ids[row : row + 1 + len(drafts)]):
            run.append(token_id)
            if j == len(drafts) or token_id != drafts[j]:
                break
        result.sampled[s.request_id] = run
        result.logprobs[s.request_id] = out.logprobs[row : row + len(run)]
        row += 1 + len(drafts)
        if (
            s.request_id in states and s.generator is not None
        ):  # the generator drew for every row: as if it drew for the run only
            s.generator.set_state(states[s.request_id])
            for _ in run:
                torch.rand((1,), device=logits.device, generator=s.generator)
    return result
