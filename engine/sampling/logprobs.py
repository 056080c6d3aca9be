"""Logprobs: of the sampled tokens (after the logit processors, before temperature and the cuts)
and of prompt tokens (the model's own logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import TokenLogprob
from engine.sampling.metadata import SamplingBatch
from engine.sampling.top_k_top_p import softmax


def token_logprobs(
    logprobs: torch.Tensor | None, token_ids: torch.Tensor, batch: SamplingBatch
) -> list[TokenLogprob | None]:
    if logprobs is None:
        return [None] * batch.num_rows
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_k = batch.max_logprobs or 0  # not None: a row wants logprobs
    top_values, top_ids = ([], []) if max_k == 0 else (t.tolist() for t in logprobs.topk(max_k, dim=-1))
    ids = token_ids.tolist()
    out: list[TokenLogprob | None] = []
    for row, k in enumerate(batch.num_logprobs):
        top = list(zip(top_ids[row][:k], top_values[row][:k])) if k else []
        out.append(None if k is None else TokenLogprob(token_id=ids[row], logprob=chosen[row], top=top))
    return out


def prompt_logprobs(logits: torch.Tensor, target_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Each row's logprob of its target token (the prompt token that follows the row), its rank,
    and the `num_top` best tokens: logits (N, V) as the model gave them, nothing applied."""
    logprobs = softmax(logits, log=True)  # (N, V)
    targets = torch.tensor(target_ids, dtype=torch.int64, device=logits.device).unsqueeze(1)  # (N, 1)
    chosen = logprobs.gather(1, targets)  # (N, 1)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    top_values, top_ids = (
        ([[]] * len(target_ids),) * 2 if num_top == 0 else (t.tolist() for t in logprobs.topk(num_top, dim=-1))
    )
    return [
        TokenLogprob(token_id=t, logprob=lp, top=list(zip(ids, values)), rank=rank)
        for t, lp, ids, values, rank in zip(target_ids, chosen.squeeze(1).tolist(), top_ids, top_values, ranks)
    ]
