"""Drawing: greedy rows take the argmax; a random row takes the inverse-CDF draw of one uniform
from its own generator (or the step's shared one), so a seeded row draws exactly one number a step.
"""

from __future__ import annotations

import torch

from engine.sampling.metadata import SamplingBatch
from engine.sampling.top_k_top_p import sampling_probs
from models.layers import cpu_kernels


def greedy_argmax(logits: torch.Tensor, block: int = 128) -> torch.Tensor:
    """logits.argmax(dim=-1), same index on ties (the first), faster on CPU.

    With our kernels, one op (cpu_kernels.argmax_rows), a third of the torch ops' time once the
    forward pass has left every cache cold. Else: torch's argmax over a large vocabulary runs a
    scalar loop; amax is vectorised. So find each row's first block holding its maximum, then
    the first maximum inside it:

        row     [ b0 | b1 | b2 | ... ]   blocks of `block` logits
        amax      .2   .9   .9          -> first block with the max: b1
        argmax inside b1 -> index = 1 * block + offset
    """
    if logits.dtype == torch.float32 and cpu_kernels.usable(logits):
        return cpu_kernels.argmax_rows(logits)
    num_rows, vocab_size = logits.shape
    if vocab_size % block or vocab_size < 2 * block:
        return logits.argmax(dim=-1)
    blocks = logits.view(num_rows, vocab_size // block, block)  # (N, num_blocks, block)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)  # (N,)
    rows = torch.arange(num_rows, device=logits.device)
    return best_block * block + blocks[rows, best_block].argmax(dim=-1)  # (N,)


def _uniforms(batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """One uniform u per row, (N, 1): a seeded row's from its own generator, one number per step;
    greedy rows' are 0 (discarded)."""
    u = torch.zeros((batch.num_rows, 1), device=device)
    if batch.unseeded_rows is not None:
        u[batch.unseeded_rows] = torch.rand(
            (batch.unseeded_rows.numel(), 1), device=device, generator=batch.default_generator
        )
    for row, generator in batch.seeded_rows:
        u[row] = torch.rand((1,), device=device, generator=generator)
    return u


def draw_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each row's token drawn from its sampling distribution with its uniform. On CPU with our
    kernels, one op (cpu_kernels.draw_rows: 2-3 passes over the row, the same token on every CPU)
    where torch's ops took 5 (divide, softmax, cumsum, two searchsorteds), paid by every sampled
    row of every step and by each of a verification's k + 1, and top-k / top-p / min-p ~10 more
    (topk, softmax, gathers, cumsums, masks). Timings: docs/benchmarks.md, "The sampler"."""
    if not (logits.dtype == torch.float32 and cpu_kernels.usable(logits)):
        return _draw(sampling_probs(logits, batch), batch)
    token_ids = cpu_kernels.draw_rows(logits, *draw_knobs(batch, _uniforms(batch, logits.device).squeeze(1)))
    if bool((token_ids < 0).any()):  # no token left to draw (every logit -inf): the most probable, as _draw
        token_ids = torch.where(token_ids < 0, logits.argmax(dim=-1), token_ids)
    return token_ids


def draw_knobs(batch: SamplingBatch, u: torch.Tensor) -> tuple:
    """cpu_kernels.draw_rows's arguments after the logits, one number a row: temperature, u,
    top_k (vocab_size: none), top_p (1: none), min_p (None where no row has them)."""
    n, device = batch.num_rows, u.device
    temperature = batch.temperature[:, 0] if batch.temperature is not None else torch.ones(n, device=device)
    top_k = top_p = None
    if (f := batch.top_k_top_p) is not None:
        top_k = torch.full((n,), batch.vocab_size, dtype=torch.int64, device=device).index_copy_(
            0, f.rows, f.top_k[:, 0]
        )
        if f.top_p is not None:
            top_p = torch.ones(n, device=device).index_copy_(0, f.rows, f.top_p[:, 0])
    return temperature, u, top_k, top_p, batch.min_p[:, 0] if batch.min_p is not None else None


def _draw(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u * total (what torch.multinomial
    does for one sample), for each row's uniform u."""
    u = _uniforms(batch, probs.device)  # (N, 1)
    cdf = probs.cumsum(dim=-1)  # (N, V), non-decreasing
    total = cdf[:, -1:].contiguous()  # (N, 1)
    token_ids = torch.searchsorted(cdf, u * total, right=True)
    # u * total can round up to total; never step past the last token with probability.
    token_ids = torch.minimum(token_ids, torch.searchsorted(cdf, total)).squeeze(1)
    # A row with no probability left (every token -inf) or NaN ones has no distribution to
    # draw from: it takes its most probable token, and an id in the vocabulary whatever happens.
    drawable = (torch.isfinite(total) & (total > 0)).squeeze(1)  # (N,)
    if not bool(drawable.all()):  # rare: the argmax over the vocabulary is a fifth of a 1-row draw
        token_ids = torch.where(drawable, token_ids, probs.nan_to_num(nan=0.0).argmax(dim=-1))
    return token_ids.clamp_(0, probs.shape[1] - 1)
