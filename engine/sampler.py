"""Sampling: a step's logits + each request's SamplingParams -> next tokens (+ logprobs).

Pure functions over batch tensors, one row per request that samples this step.
The order follows vLLM:

    logits (N, V) float32
      -> logit_bias                     sparse adds
      -> min_tokens                     EOS / stop_token_ids -> -inf until a row has min_tokens outputs
      -> repetition penalty             prompt + output tokens (HF / vLLM semantics)
      -> frequency, presence penalties  output tokens only (OpenAI semantics)
      -> grammar                        tokens a constrained row's grammar forbids -> -inf
      == logprobs are read here         log_softmax of these logits
      -> temperature -> top-k -> top-p -> min-p -> probs
      -> greedy rows: argmax; other rows: inverse-CDF draw of one uniform from the row's generator

Each stage is a module of engine/sampling/: metadata (SamplingBatch: the params as batch
tensors), processors (logit_bias to grammar), top_k_top_p (temperature to min-p, softmax),
draw (argmax, uniforms, the draw) and logprobs; `sample` below runs them in that order.

Logprobs are those of the model's distribution *after* logit_bias, min_tokens,
the penalties and the grammar but *before* temperature, top-k, top-p and min-p. vLLM returns
the raw model's by default; we include the request's hard edits to the logits
(so a banned token shows up as -inf) but not the sampling knobs, so the numbers
do not change when a client only changes its temperature, as with OpenAI.

Penalties touch only the (row, token) pairs that occurred, so they cost
O(tokens seen), not O(N * V). A seeded row's token depends only on its own
logits and generator, whatever else is in the batch and whatever the thread count:
every reduction over the vocabulary is one row's (softmax, log_softmax, cumsum, topk, max),
none a torch `.sum()` over a row, which torch splits across threads when the row is alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import TokenLogprob
from engine.sampling.draw import draw_knobs, draw_tokens, greedy_argmax
from engine.sampling.logprobs import prompt_logprobs, token_logprobs
from engine.sampling.metadata import SamplingBatch, TokenHistory, TopKTopP, make_generator
from engine.sampling.processors import process_logits
from engine.sampling.top_k_top_p import sampling_logits, sampling_probs, softmax
from models.layers import cpu_kernels

__all__ = [
    "SamplerOutput",
    "SamplingBatch",
    "TokenHistory",
    "TopKTopP",
    "cpu_kernels",
    "draw_knobs",
    "greedy_argmax",
    "make_generator",
    "process_logits",
    "prompt_logprobs",
    "sample",
    "sampling_logits",
    "sampling_probs",
    "softmax",
]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows that asked for no logprobs


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pick one token per row of `logits` (N, vocab); the caller's tensor is left untouched."""
    if logits.shape != (batch.num_rows, batch.vocab_size):
        raise ValueError(
            f"logits have shape {tuple(logits.shape)}, batch expects ({batch.num_rows}, {batch.vocab_size})"
        )
    logits = process_logits(logits, batch)
    logprobs = softmax(logits, log=True) if batch.max_logprobs is not None else None
    if batch.all_greedy:
        token_ids = greedy_argmax(logits)
    else:
        token_ids = draw_tokens(logits, batch)
        if batch.greedy is not None:
            token_ids = torch.where(batch.greedy, greedy_argmax(logits), token_ids)
    return SamplerOutput(token_ids.tolist(), token_logprobs(logprobs, token_ids, batch))
