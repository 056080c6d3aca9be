"""Logit processors: logit_bias, min_tokens, the penalties and the grammar mask, as sparse edits
on a float32 copy of a step's logits (the edits logprobs are read after).
"""

from __future__ import annotations

import torch

from engine.sampling.metadata import SamplingBatch

# Edited logits are clamped below this, so that dividing by the smallest temperature that
# is not greedy (GREEDY_TEMPERATURE) stays finite in float32 (max ~3.4e38); NaN from an
# edit (e.g. -inf * 0) becomes -inf.
_MAX_LOGIT = 1e30


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, min_tokens masking, penalties and grammars, on a float32 copy of `logits`
    (no copy when no row has any of them: later steps never write in place)."""
    edits = (batch.logit_bias, batch.banned, batch.repetition, batch.counts, batch.allowed)
    if all(edit is None for edit in edits):
        return logits.to(torch.float32)  # (N, V), the same tensor when it is float32 already
    logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    flat = logits.view(-1)  # (N * V,) shares storage with logits
    # Every edit is sparse and its results pass through _finite, so that whatever the
    # parameters no edited logit is NaN or +inf (which would make the probabilities NaN).
    if batch.logit_bias is not None:
        index, bias = batch.logit_bias  # one entry per (row, token): keys of a dict
        flat[index] = _finite(flat[index] + bias)
    if batch.banned is not None:
        flat[batch.banned] = float("-inf")
    # Each (row, token) index occurs once; the frequency term comes multiplied by its count.
    if batch.repetition is not None:
        index, penalty = batch.repetition
        seen = flat[index]
        # Make a seen token less likely whatever the sign of its logit.
        flat[index] = _finite(torch.where(seen > 0, seen / penalty, seen * penalty))
    if batch.counts is not None:
        index, frequency, presence = batch.counts
        flat[index] = _finite(flat[index] - presence - frequency)
    if batch.allowed is not None:  # last: no edit above can bring a forbidden token back
        rows, allowed = batch.allowed
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def _finite(values: torch.Tensor) -> torch.Tensor:
    """Edited logits made safe to sample from: NaN -> -inf, anything above _MAX_LOGIT -> _MAX_LOGIT."""
    return values.nan_to_num(nan=float("-inf")).clamp_(max=_MAX_LOGIT)
