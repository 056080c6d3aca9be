"""Sampling: a step's logits + each request's SamplingParams -> next tokens (+ logprobs).

Pure functions over batch tensors, one row per request that samples this step.
The order follows vLLM:

    logits (N, V) float32
      -> logit_bias                     sparse adds
      -> min_tokens                     EOS / stop_token_ids -> -inf until a row has min_tokens outputs
      -> repetition penalty             prompt + output tokens (HF / vLLM semantics)
      -> frequency, presence penalties  output tokens only (OpenAI semantics)
      == logprobs are read here         log_softmax of these logits
      -> temperature -> top-k -> top-p -> min-p -> probs
      -> greedy rows: argmax; other rows: exponential race with the row's own generator

Logprobs are those of the model's distribution *after* logit_bias, min_tokens
and the penalties but *before* temperature, top-k, top-p and min-p. vLLM returns
the raw model's by default; we include the request's hard edits to the logits
(so a banned token shows up as -inf) but not the sampling knobs, so the numbers
do not change when a client only changes its temperature, as with OpenAI.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import SamplingParams, TokenLogprob

# Temperatures below this are greedy: dividing by them would overflow float32.
_GREEDY_TEMPERATURE = 1e-5


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator, so that its seeded draws never depend on its batch."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows that asked for no logprobs


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling tensors for one step; anything no row needs is None (and skipped)."""

    num_rows: int
    vocab_size: int
    greedy: torch.Tensor  # (N,) bool
    all_greedy: bool
    temperature: torch.Tensor | None  # (N, 1) float32, 1.0 on greedy rows; None if all greedy
    top_k: torch.Tensor | None  # (N, 1) int64, vocab_size where disabled
    top_p: torch.Tensor | None  # (N, 1) float32, 1.0 where disabled
    min_p: torch.Tensor | None  # (N, 1) float32, 0.0 where disabled
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None  # rows, token ids masked by min_tokens
    repetition_penalty: torch.Tensor | None  # (N, 1) float32, 1.0 where neutral
    seen: torch.Tensor | None  # (N, V) bool: token occurs in prompt or output
    frequency_penalty: torch.Tensor | None  # (N, 1) float32
    presence_penalty: torch.Tensor | None  # (N, 1) float32
    output_counts: torch.Tensor | None  # (N, V) float32: occurrences among generated tokens
    num_logprobs: tuple[int | None, ...]  # per row: None = no logprobs, k = chosen + top-k
    seeded_rows: tuple[tuple[int, torch.Generator], ...]  # random rows with their own generator
    unseeded_rows: torch.Tensor | None  # (M,) int64 random rows drawing from default_generator
    default_generator: torch.Generator | None  # None: torch's default generator

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] | Sequence[Sequence[int]] = (),
        default_generator: torch.Generator | None = None,
    ) -> SamplingBatch:
        """Build the batch. `eos_token_ids` is either the model's EOS ids (shared by every
        row) or one list per row; rows with `ignore_eos` do not have EOS masked by min_tokens.
        """
        num_rows = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows:
            raise ValueError(
                f"params, prompt_token_ids, output_token_ids and generators must have one entry per "
                f"row; got {num_rows}, {len(prompt_token_ids)}, {len(output_token_ids)}, {len(generators)}")
        eos_per_row = _eos_per_row(eos_token_ids, num_rows)

        def column(values, dtype):  # (N, 1)
            return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

        greedy = [p.temperature < _GREEDY_TEMPERATURE for p in params]
        all_greedy = all(greedy)
        temperature = top_k = top_p = min_p = None
        if not all_greedy:
            temperature = column([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32)
            # Greedy rows keep neutral values: they never read the sampling distribution.
            ks = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
            ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
            mins = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
            top_k = column(ks, torch.int64) if min(ks) < vocab_size else None
            top_p = column(ps, torch.float32) if min(ps) < 1.0 else None
            min_p = column(mins, torch.float32) if max(mins) > 0.0 else None

        bias_rows, bias_ids, bias_values = [], [], []
        banned_rows, banned_ids = [], []
        for row, p in enumerate(params):
            for token_id, value in p.logit_bias.items():
                if not 0 <= token_id < vocab_size:
                    raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary (size {vocab_size})")
                bias_rows.append(row), bias_ids.append(token_id), bias_values.append(value)
            if len(output_token_ids[row]) < p.min_tokens:
                stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_per_row[row])
                # An id the model cannot produce needs no masking.
                stops = sorted(t for t in stops if 0 <= t < vocab_size)
                banned_rows += [row] * len(stops)
                banned_ids += stops
        logit_bias = banned = None
        if bias_rows:
            logit_bias = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device),
                          torch.tensor(bias_values, dtype=torch.float32, device=device))
        if banned_rows:
            banned = (torch.tensor(banned_rows, device=device), torch.tensor(banned_ids, device=device))

        repetition_penalty = seen = None
        repeat_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if repeat_rows:
            repetition_penalty = column([p.repetition_penalty for p in params], torch.float32)
            seen = _occurrences(
                repeat_rows, [list(prompt_token_ids[i]) + list(output_token_ids[i]) for i in repeat_rows],
                num_rows, vocab_size, device) > 0
        frequency_penalty = presence_penalty = output_counts = None
        count_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0 or p.presence_penalty != 0]
        if count_rows:
            frequency_penalty = column([p.frequency_penalty for p in params], torch.float32)
            presence_penalty = column([p.presence_penalty for p in params], torch.float32)
            output_counts = _occurrences(
                count_rows, [output_token_ids[i] for i in count_rows], num_rows, vocab_size, device)

        seeded_rows = tuple((i, gen) for i, gen in enumerate(generators) if gen is not None and not greedy[i])
        seeded = {i for i, _ in seeded_rows}
        unseeded = [i for i in range(num_rows) if not greedy[i] and i not in seeded]
        return cls(
            num_rows=num_rows, vocab_size=vocab_size,
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device), all_greedy=all_greedy,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            logit_bias=logit_bias, banned=banned,
            repetition_penalty=repetition_penalty, seen=seen,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, output_counts=output_counts,
            num_logprobs=tuple(p.logprobs for p in params),
            seeded_rows=seeded_rows,
            unseeded_rows=torch.tensor(unseeded, dtype=torch.int64, device=device) if unseeded else None,
            default_generator=default_generator,
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pick one token per row of `logits` (N, vocab); the caller's tensor is left untouched."""
    if logits.shape != (batch.num_rows, batch.vocab_size):
        raise ValueError(f"logits have shape {tuple(logits.shape)}, batch expects "
                         f"({batch.num_rows}, {batch.vocab_size})")
    logits = process_logits(logits, batch)
    logprobs = torch.log_softmax(logits, dim=-1) if _max_logprobs(batch) is not None else None
    if batch.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        sampled = _exponential_race(sampling_probs(logits, batch), batch)
        token_ids = torch.where(batch.greedy, logits.argmax(dim=-1), sampled)
    return SamplerOutput(token_ids.tolist(), _token_logprobs(logprobs, token_ids, batch))


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, min_tokens masking and penalties, on a float32 copy of `logits`."""
    logits = logits.to(torch.float32, copy=True)
    if batch.logit_bias is not None:
        rows, ids, values = batch.logit_bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if batch.banned is not None:
        logits[batch.banned] = float("-inf")
    if batch.seen is not None:
        penalty = batch.repetition_penalty
        # Shrink a seen token's logit toward "less likely" whatever its sign.
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(batch.seen, penalised, logits)
    if batch.output_counts is not None:
        counts = batch.output_counts
        logits -= batch.frequency_penalty * counts + batch.presence_penalty * (counts > 0)
    return logits


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution random rows draw from: temperature, top-k, top-p, min-p on
    processed logits (N, V) -> probs (N, V). Greedy rows get a plain softmax."""
    if batch.temperature is not None:
        logits = logits / batch.temperature
    if batch.top_k is not None or batch.top_p is not None:
        logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = logits.softmax(dim=-1)
    if batch.min_p is not None:
        # Relative to the most likely token, which renormalising by top-k/top-p does not change.
        too_unlikely = probs < probs.amax(dim=-1, keepdim=True) * batch.min_p
        probs = logits.masked_fill(too_unlikely, float("-inf")).softmax(dim=-1)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's k best tokens (exactly k: ties go to the lower id), then the
    smallest best-first prefix whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # (N, V)
    if top_k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(rank >= top_k, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token: the best token always stays (top_p > 0).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        mass_before[:, 0] = 0.0
        sorted_logits.masked_fill_((mass_before >= top_p) & (top_p < 1.0), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential_race(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """argmax(p / q) with q ~ Exp(1) i.i.d. is a draw from p (the Gumbel-max trick in
    another guise). A seeded row fills its q from its own generator, one vocab-sized draw
    per step, so its tokens depend only on its logits and its seed."""
    q = torch.ones_like(probs)  # (N, V); rows left at 1 are greedy and discarded
    if batch.unseeded_rows is not None:
        if batch.unseeded_rows.numel() == batch.num_rows:
            q.exponential_(generator=batch.default_generator)
        else:
            fresh = torch.empty((batch.unseeded_rows.numel(), probs.shape[1]), device=probs.device)
            q[batch.unseeded_rows] = fresh.exponential_(generator=batch.default_generator)
    for row, generator in batch.seeded_rows:
        q[row].exponential_(generator=generator)
    # q == 0 has probability ~0 but would turn 0/0 into NaN, which argmax would pick.
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    return probs.div_(q).argmax(dim=-1)


def _max_logprobs(batch: SamplingBatch) -> int | None:
    wanted = [k for k in batch.num_logprobs if k is not None]
    return max(wanted) if wanted else None


def _token_logprobs(logprobs: torch.Tensor | None, token_ids: torch.Tensor,
                    batch: SamplingBatch) -> list[TokenLogprob | None]:
    if logprobs is None:
        return [None] * batch.num_rows
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_k = _max_logprobs(batch)
    top_values, top_ids = ([], []) if max_k == 0 else (t.tolist() for t in logprobs.topk(max_k, dim=-1))
    ids = token_ids.tolist()
    out: list[TokenLogprob | None] = []
    for row, k in enumerate(batch.num_logprobs):
        if k is None:
            out.append(None)
            continue
        top = list(zip(top_ids[row][:k], top_values[row][:k])) if k else []
        out.append(TokenLogprob(token_id=ids[row], logprob=chosen[row], top=top))
    return out


def _occurrences(rows: list[int], token_lists: Sequence[Sequence[int]], num_rows: int, vocab_size: int,
                 device: torch.device | str) -> torch.Tensor:
    """(num_rows, vocab) float32 counts of each row's tokens; rows not listed stay zero."""
    counts = torch.zeros((num_rows, vocab_size), dtype=torch.float32, device=device)
    lengths = [len(tokens) for tokens in token_lists]
    if sum(lengths):
        row_index = torch.repeat_interleave(torch.tensor(rows, device=device), torch.tensor(lengths, device=device))
        token_index = torch.tensor([t for tokens in token_lists for t in tokens], device=device)
        counts.index_put_((row_index, token_index), torch.ones_like(token_index, dtype=torch.float32),
                          accumulate=True)
    return counts


def _eos_per_row(eos_token_ids: Sequence[int] | Sequence[Sequence[int]], num_rows: int) -> list[Sequence[int]]:
    if all(isinstance(t, int) for t in eos_token_ids):
        return [eos_token_ids] * num_rows  # type: ignore[list-item]
    if len(eos_token_ids) != num_rows:
        raise ValueError(f"eos_token_ids has {len(eos_token_ids)} per-row lists for {num_rows} rows")
    return list(eos_token_ids)  # type: ignore[arg-type]
