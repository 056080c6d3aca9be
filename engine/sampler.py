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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import SamplingParams, TokenLogprob
from engine.structured import GrammarMatcher, allowed_tokens
from models.layers import cpu_kernels

# Top-p rows look for their nucleus among this many best tokens first, then 16x as
# many; only a row whose nucleus is wider still pays for a full sort of the vocabulary.
_TOP_P_CANDIDATES = 256
# Edited logits are clamped below this, so that dividing by the smallest temperature that
# is not greedy (GREEDY_TEMPERATURE) stays finite in float32 (max ~3.4e38); NaN from an
# edit (e.g. -inf * 0) becomes -inf.
_MAX_LOGIT = 1e30


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator, so that its seeded draws never depend on its batch."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class TokenHistory:
    """One request's tokens as its penalties read them, kept across steps and extended by
    the new tokens only, so building a step's penalty tensors costs O(new tokens) in Python:

        seen        unique ids of prompt + output     (repetition_penalty)
        out_ids     unique ids of the output          (frequency, presence)
        out_counts  how often each of out_ids occurs  (frequency)

    Buffers grow by doubling; the first `num_*` entries are live.
    """

    def __init__(self, device: torch.device | str):
        self.device = device
        self.num_prompt_tokens = self.num_output_tokens = 0
        self.num_tokens_added = 0  # tokens ever taken in: equals prompt + output unless rebuilt
        self._seen_pos: dict[int, None] = {}
        self._out_pos: dict[int, int] = {}
        self._seen = torch.empty(16, dtype=torch.int64, device=device)
        self._out_ids = torch.empty(16, dtype=torch.int64, device=device)
        self._out_counts = torch.empty(16, dtype=torch.float32, device=device)

    def update(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> TokenHistory:
        other_prompt = self.num_prompt_tokens and len(prompt_token_ids) != self.num_prompt_tokens
        if other_prompt or len(output_token_ids) < self.num_output_tokens:  # not what it was built from
            self.__init__(self.device)
        if not self.num_prompt_tokens:
            self._add_seen(prompt_token_ids)
            self.num_prompt_tokens = len(prompt_token_ids)
        new = output_token_ids[self.num_output_tokens:]
        if new:
            self._add_seen(new)
            for token_id in new:
                pos = self._out_pos.get(token_id)
                if pos is None:
                    self._out_pos[token_id] = pos = len(self._out_pos)
                    self._out_ids = _grown(self._out_ids, pos + 1)
                    self._out_counts = _grown(self._out_counts, pos + 1)
                    self._out_ids[pos], self._out_counts[pos] = token_id, 0.0
                self._out_counts[pos] += 1.0
            self.num_output_tokens = len(output_token_ids)
        return self

    def _add_seen(self, token_ids: Sequence[int]) -> None:
        self.num_tokens_added += len(token_ids)
        fresh = [t for t in dict.fromkeys(token_ids) if t not in self._seen_pos]
        if fresh:
            start = len(self._seen_pos)
            self._seen_pos.update(dict.fromkeys(fresh))
            self._seen = _grown(self._seen, start + len(fresh))
            self._seen[start:start + len(fresh)] = torch.tensor(fresh, dtype=torch.int64, device=self.device)

    @property
    def seen(self) -> torch.Tensor:
        return self._seen[:len(self._seen_pos)]  # (num_seen,)

    @property
    def output(self) -> tuple[torch.Tensor, torch.Tensor]:
        num = len(self._out_pos)
        return self._out_ids[:num], self._out_counts[:num]  # (num_out,), (num_out,)


def _grown(buffer: torch.Tensor, size: int) -> torch.Tensor:
    if size <= buffer.numel():
        return buffer
    grown = buffer.new_empty(max(size, 2 * buffer.numel()))
    grown[:buffer.numel()] = buffer
    return grown


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows that asked for no logprobs


@dataclass(frozen=True)
class TopKTopP:
    """The M rows of a batch that use top-k and/or top-p."""

    rows: torch.Tensor  # (M,) int64 row indices into the batch
    top_k: torch.Tensor  # (M, 1) int64, vocab_size where the row has no top-k
    top_p: torch.Tensor | None  # (M, 1) float32, 1.0 where the row has no top-p; None if no row has
    has_top_k: torch.Tensor  # (M, 1) bool
    any_top_k: bool
    width: int  # candidates looked at first: the largest top-k, or _TOP_P_CANDIDATES for top-p-only rows

    @classmethod
    def build(cls, params, greedy, vocab_size, device) -> TopKTopP | None:
        rows, ks, ps = [], [], []
        for row, (p, is_greedy) in enumerate(zip(params, greedy)):
            k = min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
            if not is_greedy and (k < vocab_size or p.top_p < 1.0):
                rows.append(row), ks.append(k), ps.append(p.top_p)
        if not rows:
            return None
        top_k = torch.tensor(ks, dtype=torch.int64, device=device).unsqueeze(1)
        return cls(rows=torch.tensor(rows, dtype=torch.int64, device=device), top_k=top_k,
                   top_p=torch.tensor(ps, device=device).unsqueeze(1) if min(ps) < 1.0 else None,
                   has_top_k=top_k < vocab_size, any_top_k=min(ks) < vocab_size,
                   width=max(k if k < vocab_size else min(_TOP_P_CANDIDATES, vocab_size) for k in ks))


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling tensors for one step; anything no row needs is None (and skipped).

    Sparse edits address the logits flattened: index = row * vocab_size + token_id.
    """

    num_rows: int
    vocab_size: int
    greedy: torch.Tensor | None  # (N,) bool, only when greedy and random rows are mixed
    all_greedy: bool
    temperature: torch.Tensor | None  # (N, 1) float32, 1.0 on greedy rows; None if all are 1 or greedy
    top_k_top_p: TopKTopP | None
    min_p: torch.Tensor | None  # (N, 1) float32, 0.0 where disabled
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None  # flat index, value to add
    banned: torch.Tensor | None  # flat index of tokens min_tokens masks
    repetition: tuple[torch.Tensor, torch.Tensor] | None  # flat index of each prompt/output token, penalty
    counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # unique output tokens: flat index, frequency x count, presence
    allowed: tuple[torch.Tensor, torch.Tensor] | None  # constrained rows (C,), what each allows (C, V) bool
    num_logprobs: tuple[int | None, ...]  # per row: None = no logprobs, k = chosen + top-k
    max_logprobs: int | None  # None when no row wants logprobs
    seeded_rows: tuple[tuple[int, torch.Generator], ...]  # random rows with their own generator
    unseeded_rows: torch.Tensor | None  # (R,) int64 random rows drawing from default_generator
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
        histories: Sequence[TokenHistory | None] | None = None,
        grammars: Sequence[GrammarMatcher | None] | None = None,
        allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplingBatch:
        """`eos_token_ids` is either the model's EOS ids (shared by every row) or one list
        per row; rows with `ignore_eos` do not have EOS masked by min_tokens. `histories`:
        each row's TokenHistory kept from earlier steps (brought up to date here); rows
        without one get a fresh one. `grammars`: each row's matcher, None where the row is
        unconstrained; every constrained row's mask is computed here, in one call. `allowed`:
        the masks computed already instead (constrained rows, (C, V) bool), e.g. with drafts."""
        num_rows = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows:
            raise ValueError(
                f"params, prompt_token_ids, output_token_ids and generators must have one entry per "
                f"row; got {num_rows}, {len(prompt_token_ids)}, {len(output_token_ids)}, {len(generators)}")
        eos_per_row = _eos_per_row(eos_token_ids, num_rows)

        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        temperature = top_k_top_p = min_p = None
        if not all_greedy:  # greedy rows never read the sampling distribution: neutral values
            temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
            mins = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
            temperature = tensor(temps, torch.float32).unsqueeze(1) if any(t != 1.0 for t in temps) else None
            min_p = tensor(mins, torch.float32).unsqueeze(1) if max(mins) > 0.0 else None
            top_k_top_p = TopKTopP.build(params, greedy, vocab_size, device)

        bias_index, bias_values, banned = [], [], []
        for row, p in enumerate(params):
            for token_id, value in p.logit_bias.items():
                if not 0 <= token_id < vocab_size:
                    raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary (size {vocab_size})")
                bias_index.append(row * vocab_size + token_id), bias_values.append(value)
            if len(output_token_ids[row]) < p.min_tokens and p.structured is None:  # a grammar places EOS
                stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_per_row[row])
                banned += [row * vocab_size + t for t in stops if 0 <= t < vocab_size]  # others cannot occur

        def history(i: int) -> TokenHistory:
            cached = histories[i] if histories is not None else None
            return (cached or TokenHistory(device)).update(prompt_token_ids[i], output_token_ids[i])

        # Each (row, token) once: index row * vocab_size + token of every unique token.
        repetition = counts = None
        rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rows:
            seen = [history(i).seen for i in rows]
            index, row_of = _flat_index(rows, seen, vocab_size, device)
            repetition = (index, tensor([p.repetition_penalty for p in params], torch.float32)[row_of])
        rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0 or p.presence_penalty != 0]
        if rows:
            ids, num = zip(*(history(i).output for i in rows))
            index, row_of = _flat_index(rows, ids, vocab_size, device)
            frequency = tensor([p.frequency_penalty for p in params], torch.float32)[row_of] * torch.cat(num)
            counts = (index, frequency, tensor([p.presence_penalty for p in params], torch.float32)[row_of])

        constrained = [i for i, g in enumerate(grammars or ()) if g is not None]
        if constrained and allowed is None:
            mask = allowed_tokens([grammars[i] for i in constrained], vocab_size).to(device)
            allowed = (tensor(constrained), mask)

        seeded_rows = tuple((i, gen) for i, gen in enumerate(generators) if gen is not None and not greedy[i])
        seeded = {i for i, _ in seeded_rows}
        unseeded = [i for i in range(num_rows) if not greedy[i] and i not in seeded]
        return cls(
            num_rows=num_rows, vocab_size=vocab_size, all_greedy=all_greedy,
            greedy=tensor(greedy, torch.bool) if any(greedy) and not all_greedy else None,
            temperature=temperature, top_k_top_p=top_k_top_p, min_p=min_p,
            logit_bias=(tensor(bias_index), tensor(bias_values, torch.float32)) if bias_index else None,
            banned=tensor(banned) if banned else None, repetition=repetition, counts=counts, allowed=allowed,
            num_logprobs=tuple(p.logprobs for p in params),
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            seeded_rows=seeded_rows,
            unseeded_rows=tensor(unseeded) if unseeded else None, default_generator=default_generator,
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pick one token per row of `logits` (N, vocab); the caller's tensor is left untouched."""
    if logits.shape != (batch.num_rows, batch.vocab_size):
        raise ValueError(f"logits have shape {tuple(logits.shape)}, batch expects "
                         f"({batch.num_rows}, {batch.vocab_size})")
    logits = process_logits(logits, batch)
    logprobs = softmax(logits, log=True) if batch.max_logprobs is not None else None
    if batch.all_greedy:
        token_ids = greedy_argmax(logits)
    else:
        token_ids = _draw_tokens(logits, batch)
        if batch.greedy is not None:
            token_ids = torch.where(batch.greedy, greedy_argmax(logits), token_ids)
    return SamplerOutput(token_ids.tolist(), _token_logprobs(logprobs, token_ids, batch))


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


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution random rows draw from: temperature, top-k, top-p, min-p on
    processed logits (N, V) -> probs (N, V). Greedy rows get a plain softmax."""
    return softmax(_sampling_logits(logits, batch))


def _sampling_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
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
            done, found = _top_p_threshold(values, sorted_probs, f.top_k[todo], f.top_p[todo], kept_mass[todo],
                                           exhaustive=width == vocab_size)
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


def _top_p_threshold(values, sorted_probs, top_k, top_p, kept_mass, exhaustive):
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


def _uniforms(batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """One uniform u per row, (N, 1): a seeded row's from its own generator, one number per step;
    greedy rows' are 0 (discarded)."""
    u = torch.zeros((batch.num_rows, 1), device=device)
    if batch.unseeded_rows is not None:
        u[batch.unseeded_rows] = torch.rand((batch.unseeded_rows.numel(), 1), device=device,
                                            generator=batch.default_generator)
    for row, generator in batch.seeded_rows:
        u[row] = torch.rand((1,), device=device, generator=generator)
    return u


def _draw_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
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
        top_k = torch.full((n,), batch.vocab_size, dtype=torch.int64, device=device).index_copy_(0, f.rows, f.top_k[:, 0])
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


def _token_logprobs(logprobs: torch.Tensor | None, token_ids: torch.Tensor,
                    batch: SamplingBatch) -> list[TokenLogprob | None]:
    if logprobs is None:
        return [None] * batch.num_rows
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_k = batch.max_logprobs
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
    top_values, top_ids = ([[]] * len(target_ids),) * 2 if num_top == 0 else (
        t.tolist() for t in logprobs.topk(num_top, dim=-1))
    return [TokenLogprob(token_id=t, logprob=lp, top=list(zip(ids, values)), rank=rank)
            for t, lp, ids, values, rank in zip(target_ids, chosen.squeeze(1).tolist(), top_ids, top_values, ranks)]


def _flat_index(rows: list[int], token_ids: Sequence[torch.Tensor], vocab_size: int,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token ids (a tensor per row) as flat indices row * vocab_size + token, and their rows."""
    lengths = torch.tensor([t.numel() for t in token_ids], device=device)
    row_of = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)
    return row_of * vocab_size + torch.cat(token_ids).to(device), row_of


def _eos_per_row(eos_token_ids: Sequence[int] | Sequence[Sequence[int]], num_rows: int) -> list[Sequence[int]]:
    if all(isinstance(t, int) for t in eos_token_ids):
        return [eos_token_ids] * num_rows  # type: ignore[list-item]
    if len(eos_token_ids) != num_rows:
        raise ValueError(f"eos_token_ids has {len(eos_token_ids)} per-row lists for {num_rows} rows")
    return list(eos_token_ids)  # type: ignore[arg-type]
