"""A step's sampling metadata: each row's SamplingParams, token history, grammar mask and
generator as the batch tensors the later stages read (None where no row needs one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import SamplingParams
from engine.structured import GrammarMatcher, allowed_tokens

# Top-p rows look for their nucleus among this many best tokens first, then 16x as
# many; only a row whose nucleus is wider still pays for a full sort of the vocabulary.
_TOP_P_CANDIDATES = 256


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
            TokenHistory.__init__(self, self.device)
        if not self.num_prompt_tokens:
            self._add_seen(prompt_token_ids)
            self.num_prompt_tokens = len(prompt_token_ids)
        new = output_token_ids[self.num_output_tokens :]
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
            self._seen[start : start + len(fresh)] = torch.tensor(fresh, dtype=torch.int64, device=self.device)

    @property
    def seen(self) -> torch.Tensor:
        return self._seen[: len(self._seen_pos)]  # (num_seen,)

    @property
    def output(self) -> tuple[torch.Tensor, torch.Tensor]:
        num = len(self._out_pos)
        return self._out_ids[:num], self._out_counts[:num]  # (num_out,), (num_out,)


def _grown(buffer: torch.Tensor, size: int) -> torch.Tensor:
    if size <= buffer.numel():
        return buffer
    grown = buffer.new_empty(max(size, 2 * buffer.numel()))
    grown[: buffer.numel()] = buffer
    return grown


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
    def build(
        cls, params: Sequence[SamplingParams], greedy: Sequence[bool], vocab_size: int, device: torch.device | str
    ) -> TopKTopP | None:
        rows: list[int] = []
        ks: list[int] = []
        ps: list[float] = []
        for row, (p, is_greedy) in enumerate(zip(params, greedy)):
            k = min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
            if not is_greedy and (k < vocab_size or p.top_p < 1.0):
                rows.append(row)
                ks.append(k)
                ps.append(p.top_p)
        if not rows:
            return None
        top_k = torch.tensor(ks, dtype=torch.int64, device=device).unsqueeze(1)
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            top_k=top_k,
            top_p=torch.tensor(ps, device=device).unsqueeze(1) if min(ps) < 1.0 else None,
            has_top_k=top_k < vocab_size,
            any_top_k=min(ks) < vocab_size,
            width=max(k if k < vocab_size else min(_TOP_P_CANDIDATES, vocab_size) for k in ks),
        )


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
    counts: (
        tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    )  # unique output tokens: flat index, frequency x count, presence
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
                f"row; got {num_rows}, {len(prompt_token_ids)}, {len(output_token_ids)}, {len(generators)}"
            )
        eos_per_row = _eos_per_row(eos_token_ids, num_rows)

        def tensor(values: Sequence[float], dtype: torch.dtype = torch.int64) -> torch.Tensor:
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
                bias_index.append(row * vocab_size + token_id)
                bias_values.append(value)
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
            mask = allowed_tokens([g for g in grammars or () if g is not None], vocab_size).to(device)
            allowed = (tensor(constrained), mask)

        seeded_rows = tuple((i, gen) for i, gen in enumerate(generators) if gen is not None and not greedy[i])
        seeded = {i for i, _ in seeded_rows}
        unseeded = [i for i in range(num_rows) if not greedy[i] and i not in seeded]
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            greedy=tensor(greedy, torch.bool) if any(greedy) and not all_greedy else None,
            temperature=temperature,
            top_k_top_p=top_k_top_p,
            min_p=min_p,
            logit_bias=(tensor(bias_index), tensor(bias_values, torch.float32)) if bias_index else None,
            banned=tensor(banned) if banned else None,
            repetition=repetition,
            counts=counts,
            allowed=allowed,
            num_logprobs=tuple(p.logprobs for p in params),
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            seeded_rows=seeded_rows,
            unseeded_rows=tensor(unseeded) if unseeded else None,
            default_generator=default_generator,
        )


def _flat_index(
    rows: list[int], token_ids: Sequence[torch.Tensor], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token ids (a tensor per row) as flat indices row * vocab_size + token, and their rows."""
    lengths = torch.tensor([t.numel() for t in token_ids], device=device)
    row_of = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)
    return row_of * vocab_size + torch.cat(list(token_ids)).to(device), row_of


def _eos_per_row(eos_token_ids: Sequence[int] | Sequence[Sequence[int]], num_rows: int) -> list[Sequence[int]]:
    if all(isinstance(t, int) for t in eos_token_ids):
        return [eos_token_ids] * num_rows  # type: ignore[list-item]
    if len(eos_token_ids) != num_rows:
        raise ValueError(f"eos_token_ids has {len(eos_token_ids)} per-row lists for {num_rows} rows")
    return list(eos_token_ids)  # type: ignore[arg-type]
