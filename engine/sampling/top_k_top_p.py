"""The distribution a random row draws from: temperature, then top-k, top-p and min-p cut at a
logit value; and the row softmax every stage shares.
"""

from __future__ import annotations

import torch

from engine.sampling.metadata import SamplingBatch, TopKTopP
from models.layers import cpu_kernels


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution random rows draw from: temperature, top-k, top-p, min-p on
    processed logits (N, V) -> probs (N, V). Greedy rows get a plain softmax."""
    return softmax(sampling_logits(logits, batch))


def sampling_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Processed logits / temperature, with -inf wherever top-k, top-p or min-p cut."""
    if batch.temperature is not None:
        logits = logits / batch.temperature
    if batch.top_k_top_p is not None:
        logits = _top_k_top_p(logits, batch.top_k_top_p)
    if batch.min_p is not None:
        # Relative to the most likely token, which renormalising by top-k/top-p does not change.
        probs = softmax(logits)
        too_unlikely = probs < probs.amax(dim=-1, keepdim=True) * batch.min_p
        logits = logits.masked_fill(too_unlikely, float("-inf"))
    return logits


def softmax(logits: torch.Tensor, log: bool = False) -> torch.Tensor:
    """Softmax (or log_softmax) of each row of logits (N, V). On CPU with our kernels, in one order
    whatever the CPU: torch's own sums 8 or 16 lanes as the CPU allows and calls its own exp, so a
    seeded request's logprobs (and, rarely, a token) differed between an AVX2 and an AVX-512 CPU.
    A row whose logits are all -inf gets probabilities 0 and logprobs -inf there (torch: NaN)."""
    if logits.dtype == torch.float32 and cpu_kernels.usable(logits):
        return cpu_kernels.softmax_rows(logits, log)
    return logits.log_softmax(dim=-1) if log else logits.softmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, f: TopKTopP) -> torch.Tensor:
    """Keep the k best tokens, then the smallest best-first prefix of those whose
    probability reaches top_p. Both cut at a logit value, so tokens tied with the last
    one kept stay too (as in vLLM) and the result does not depend on how ties sort.

    Sorting the vocabulary is the slow part. Top-k needs only the k best; top-p alone
    usually finds its nucleus among a few hundred best tokens, and only rows where it
    does not look further. A row's threshold is the same whichever width decided it.
    """
    all_rows = f.rows.numel() == logits.shape[0]
    sub = logits if all_rows else logits[f.rows]  # (M, V)
    vocab_size = sub.shape[1]
    values, ids = sub.topk(f.width, dim=-1)  # (M, W) best first
    kth = values.gather(1, f.top_k.clamp(max=f.width) - 1).masked_fill(~f.has_top_k, float("-inf"))  # (M, 1)
    if f.top_p is None:
        threshold = kth
    else:
        probs = softmax(sub)  # (M, V)
        kept_mass = torch.ones_like(kth)  # top-p renormalises over what top-k kept, ties included
        if f.any_top_k:
            # A running sum, not .sum(): torch splits the sum of one long row across threads (a
            # lone row's mass then depends on the thread count and differs from the same row in a
            # batch); cumsum adds each row's values in order, on one thread.
            kept = probs.masked_fill(sub < kth, 0.0).cumsum(dim=-1)[:, -1:]  # (M, 1)
            kept_mass = torch.where(f.has_top_k, kept, 1.0)
        threshold = torch.empty_like(kth)
        todo = torch.arange(sub.shape[0], device=sub.device)  # (M',) rows not decided yet
        sorted_probs, width = probs.gather(1, ids), f.width
        while True:
            done, found = _top_p_threshold(
                values, sorted_probs, f.top_k[todo], f.top_p[todo], kept_mass[todo], exhaustive=width == vocab_size
            )
            threshold[todo[done]] = torch.maximum(found[done], kth[todo[done]])
            todo, width = todo[~done], min(width * 16, vocab_size)
            if not todo.numel():
                break
            if width == vocab_size:
                values, ids = sub[todo].sort(dim=-1, descending=True)  # (M', V)
            else:
                values, ids = sub[todo].topk(width, dim=-1)  # (M', W)
            sorted_probs = probs[todo].gather(1, ids)
    sub = sub.masked_fill(sub < threshold, float("-inf"))
    return sub if all_rows else logits.index_copy(0, f.rows, sub)


def _top_p_threshold(
    values: torch.Tensor,
    sorted_probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    kept_mass: torch.Tensor,
    exhaustive: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """From a row's W best tokens (values, probs: (M, W), best first): which rows these
    decide, and the lowest logit each keeps."""
    width = values.shape[1]
    inclusive = sorted_probs.cumsum(dim=-1)  # (M, W)
    mass_before = inclusive - sorted_probs
    mass_before[:, 0] = 0.0  # the best token always stays
    rank = torch.arange(width, device=values.device)
    keep = (rank < top_k) & ((mass_before < top_p * kept_mass) | (top_p >= 1.0))  # a best-first prefix
    keep[:, 0] = True  # even when top_p * kept_mass underflows to 0
    num_kept = keep.sum(dim=-1, keepdim=True)  # (M, 1), >= 1
    # Undecided: all W kept without reaching top_p, so the nucleus may go on past them.
    done = (num_kept < width) | (top_k <= width) | (inclusive[:, -1:] >= top_p * kept_mass)
    return (done | exhaustive).squeeze(1), values.gather(1, num_kept - 1)
