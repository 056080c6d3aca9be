"""Speculative decoding: drafts proposed per request, checked by one step of the model.

    decode without:   [t]                  1 row of logits  -> 1 token
    decode with k=3:  [t d0 d1 d2]         4 rows of logits -> sample row 0; if it is d0, row 1; ...
                                           -> the accepted run: up to 3 drafts and one token of its own

On a CPU one stream is bound by reading every weight once per step; a step of k+1 rows reads
them once too, so each accepted draft is nearly free. Drafts are proposed here (plain Python,
no torch: the scheduler asks before it schedules a decode) and verified by the runner.

Exact, not approximate. The drafts are deterministic (no draft probabilities), so the runner
samples row j with the normal sampler, as if drafts 0..j-1 had been emitted (penalties,
min_tokens and the grammar see them), drawing from the request's own generator exactly as
decoding without drafts would, and stops at the first row whose token differs from its draft.
A row's logits are bit-identical however many rows its step has (the quantized kernels and the
one-op layers are row-invariant: tests/models/test_row_invariance.py), so greedy and seeded
requests get the same tokens and logprobs with speculation on or off.

Drafts are never tokens until accepted: they are not in `all_token_ids`, never hashed into the
prefix cache, and the KV written at rejected positions is overwritten by the next step.

Proposers behind `Proposer`: n-gram lookup over the prompt and the output so far (vLLM's
`ngram`, llama.cpp's lookup decoding), and, for constrained requests, the grammar's forced
tokens (llguidance's fast-forward) and a cut of any draft at the first token the grammar
refuses. A draft model, EAGLE or an MTP layer would add draft probabilities and a rejection
sampler; the interface leaves room for that.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from engine.request import Request

SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 5  # k: drafts per step at most (the policy picks fewer where they pay less)
    ngram_min: int = 1  # the shortest suffix of prompt + output looked up
    ngram_max: int = 4  # the longest, tried first
    # No drafts while more than this many requests run: each request's draft rows then cost a
    # whole row of the step's compute (docs/benchmarks.md, "Speculative decoding").
    max_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max <= 16, got {self.ngram_min} and {self.ngram_max}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {self.max_batch_size}")


class NgramIndex:
    """One request's n-grams of prompt + output, each mapped to where its most recent
    occurrence ends; extended by the new tokens only, so a proposal costs O(new tokens).

        tokens   a b c d x a b c ?        suffix "a b c" (n=3) last occurred at 0..2
        draft    d x a                    what followed it, up to k tokens
    """

    def __init__(self, ngram_min: int, ngram_max: int):
        self._sizes = tuple(range(ngram_max, ngram_min - 1, -1))  # longest first
        self._tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._sizes}
        self._indexed = 0  # n-grams ending before this position are in the tables

    def lookup(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(n, start): the longest suffix of `tokens` (n from ngram_max down to ngram_min) that
        occurred before, and where what followed its most recent occurrence starts; None if none."""
        # Index every n-gram that has a token after it: those ending before the last token.
        end = len(tokens) - 1
        for i in range(self._indexed, end):  # the n-gram tokens[i-n+1 .. i]; what follows starts at i+1
            for n in self._sizes:
                if i + 1 >= n:
                    self._tables[n][tuple(tokens[i + 1 - n : i + 1])] = i + 1
        self._indexed = max(self._indexed, end)
        for n in self._sizes:
            if len(tokens) > n:
                start = self._tables[n].get(tuple(tokens[len(tokens) - n :]))
                if start is not None:
                    return n, start
        return None

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        match = self.lookup(tokens)
        return _continued(tokens, match[1], k) if match is not None else []


def _continued(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens from `start` on, of the tokens followed by the draft itself: a match that ends
    less than k tokens before the end (the text repeats with period len - start) goes on repeating,
    as looking the drafted tokens up in turn would give. Without this, a loop of period 1 or 2 (greedy
    text that repeats) got drafts of 1 or 2 tokens where k were asked for.

        tokens  ... x y x y       suffix "x y" last occurred at -4..-3, followed by "x y" and the end
        draft   x y x             (k = 3): the period continued
    """
    draft = list(tokens[start : start + k])
    num_tokens = len(tokens)
    while len(draft) < k:
        draft.append(draft[start + len(draft) - num_tokens])
    return draft


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step yields with k drafts when each is accepted with probability `acceptance`
    (given the ones before it): 1 + a + a^2 + ... + a^k."""
    return sum(acceptance**i for i in range(k + 1))


# Where a draft came from -> the chance that each of its tokens is accepted, given the ones before
# it were (a prior; the engine learns the rates as it runs). FORCED: tokens the grammar allows
# alone; n >= 1: an n-gram match of n tokens. A longer match is the better guess: real SmolLM2-135M
# outputs (the loadtest.speculative workloads, t=0 and t=0.8, 5-12 requests each) accepted a
# draft's first token after a match of 1 token 6-21% of the time, of 2 tokens 39-74%, of 3 33-94%,
# of 4 or more 44-97% (open chat lowest, quoting and code edits highest).
FORCED = 0
PRIOR_ACCEPTANCE = {FORCED: 0.95, 1: 0.15, 2: 0.45, 3: 0.7, 4: 0.85}
# What one more row is taken to cost, relative to the step, until a step with it has been timed:
# low, so that a draft length is tried and then judged by its time.
UNTIMED_ROW_COST = 0.1
STEP_WINDOW = 15


def prior_acceptance(source: int) -> float:
    return PRIOR_ACCEPTANCE[min(source, max(PRIOR_ACCEPTANCE))]


@dataclass
class DraftState:
    """A request's speculation: its n-gram index and how well its drafts have done, by source."""

    index: NgramIndex
    # source (FORCED or the match length) -> per draft position, given the ones before it were accepted
    acceptance: dict[int, float] = field(default_factory=dict)
    source: int | None = None  # of the drafts proposed last (those the next verification judges)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0


@dataclass
class SpecStats:
    """Counters, with vLLM's metric names where they exist (server/metrics.py)."""

    num_drafts: int = 0  # steps in which a request carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_cut_by_grammar: int = 0  # draft tokens cut because the grammar refuses them
    num_cut_by_budget: int = 0  # draft tokens dropped for the token budget, KV blocks or max_tokens


class Proposer(Protocol):
    def propose(self, request: Request, k: int) -> list[int]:
        """Up to k draft tokens to follow request.all_token_ids (deterministic)."""


class Speculator:
    """Proposes each decode's drafts (for the scheduler) and learns from their verification.

    k per request and step: the one that maximises the step's expected tokens per unit of its time,

        (tokens - 1 + expected_tokens(a, k)) / (time of the step with k more rows / without),

    tokens = what the step is expected to yield with the drafts of the requests before this one,

    a = the acceptance rate of the draft's source (a match of n tokens, or the grammar), learned per
    request from a rate learned across requests, and the times of decode steps by (requests, rows),
    measured as the engine runs. Both matter: a match of 1 token is right ~15% of the time and one of
    4 ~85%; and a step's time is not linear in its rows (2 rows can cost what one does, 4 rows
    1.1-1.8x one, by CPU and model).
    """

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        # (greedy, source) -> the engine's rate, a request's until it has its own: greedy requests
        # and sampled ones apart (sampling at t=0.8 follows a draft less often; a run of greedy
        # requests that accepted ~90% left sampled ones on a random-weight model drafting for nothing).
        self.acceptance = {
            (greedy, source): prior_acceptance(source)
            for greedy in (False, True)
            for source in range(FORCED, config.ngram_max + 1)
        }
        # (requests, rows) -> the median time of the last STEP_WINDOW decode steps of that shape. A
        # median: one step held up (the event loop, a collection) took a running mean of a rarely seen
        # shape to 1.7x its time for dozens of steps.
        self._recent_steps: dict[tuple[int, int], deque[float]] = {}
        self._step_seconds: dict[tuple[int, int], float] = {}
        self._step: tuple[int, int, float] = (
            1,
            1,
            1.0,
        )  # the step being scheduled (begin_step): requests, rows so far, expected tokens

    def state(self, request: Request) -> DraftState:
        if request.draft_state is None:
            request.draft_state = DraftState(NgramIndex(self.config.ngram_min, self.config.ngram_max))
        return request.draft_state

    def step_cost(self, num_requests: int, rows: int, extra_rows: int) -> float:
        """The time of a decode step of `num_requests` with `rows` rows and `extra_rows` more,
        relative to the step without them; UNTIMED_ROW_COST a row until both have been timed."""
        base = self._step_seconds.get((num_requests, rows))
        more = self._step_seconds.get((num_requests, rows + extra_rows))
        if base and more:
            return more / base
        return 1.0 + UNTIMED_ROW_COST * extra_rows

    def choose_k(
        self,
        acceptance: float,
        limit: int | None = None,
        num_requests: int = 1,
        rows: int | None = None,
        tokens: float | None = None,
    ) -> int:
        """Drafts for one request of a step of `num_requests` decodes that has `rows` rows so far
        (the decodes and the drafts given to those before it) and `tokens` expected tokens."""
        limit = self.config.num_speculative_tokens if limit is None else limit
        rows = num_requests if rows is None else rows
        tokens = float(num_requests) if tokens is None else tokens
        best_k, best = 0, tokens
        for k in range(1, limit + 1):
            value = (tokens - 1 + expected_tokens(acceptance, k)) / self.step_cost(num_requests, rows, k)
            if value > best:
                best_k, best = k, value
        return best_k

    def begin_step(self, num_decodes: int) -> None:
        """A step of `num_decodes` decodes is being scheduled: drafts are proposed for it next."""
        self._step = (num_decodes, num_decodes, float(num_decodes))  # requests, rows, expected tokens

    def propose(self, request: Request, limit: int) -> list[int]:
        """Drafts for a request about to decode in the step begun last: at most `limit` (its
        max_tokens and context left), cut at the first token its grammar refuses."""
        state = self.state(request)
        state.source = None
        if limit <= 0:
            return []
        tokens = request.all_token_ids
        grammar = request.grammar
        forced = grammar.forced_tokens(limit) if grammar is not None else []
        if forced:  # what the grammar allows alone beats a guess
            source, draft = FORCED, forced
        else:
            match = state.index.lookup(tokens)
            if match is None:
                return []
            source, start = match
            draft = None
        acceptance = self.rate(request, source)
        num_requests, rows, expected = self._step
        k = self.choose_k(acceptance, limit, num_requests, rows, expected)
        if k <= 0:
            return []
        drafts = draft[:k] if draft is not None else _continued(tokens, start, k)
        if grammar is not None:
            valid = grammar.valid_prefix(drafts)
            self.stats.num_cut_by_grammar += len(drafts) - valid
            drafts = drafts[:valid]
        if drafts:
            state.source = source
            self._step = (num_requests, rows + len(drafts), expected - 1 + expected_tokens(acceptance, len(drafts)))
        return drafts

    def rate(self, request: Request, source: int) -> float:
        """The request's acceptance rate for drafts from `source` (the engine's, until it has its own)."""
        state = self.state(request)
        return state.acceptance.get(source, self.acceptance[request.params.greedy, source])

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` drafts of the request and accepted the first `num_accepted`."""
        if num_drafts == 0:
            return
        state = self.state(request)
        state.num_drafts += 1
        state.num_draft_tokens += num_drafts
        state.num_accepted += num_accepted
        if state.source is not None:
            # Per position: accepted ones were each a success; the first rejected one a failure.
            trials = min(num_accepted + 1, num_drafts)
            rate = num_accepted / trials
            source = state.source
            weight = min(0.5, 0.15 * trials)
            state.acceptance[source] = (1 - weight) * self.rate(request, source) + weight * rate
            key = (request.params.greedy, source)
            weight = min(0.2, 0.05 * trials)
            self.acceptance[key] = (1 - weight) * self.acceptance[key] + weight * rate
            state.source = None
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1

    def snapshot(self) -> SpecStats:
        stats = self.stats
        return SpecStats(
            stats.num_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            list(stats.accepted_per_position),
            stats.num_cut_by_grammar,
            stats.num_cut_by_budget,
        )

    def observe_step(self, num_requests: int, num_rows: int, seconds: float) -> None:
        """The time of a step of `num_requests` decodes and nothing else, `num_rows` rows with their
        drafts (the engine's time from schedule output to sampled tokens)."""
        key = (num_requests, num_rows)
        recent = self._recent_steps.setdefault(key, deque(maxlen=STEP_WINDOW))
        recent.append(seconds)
        self._step_seconds[key] = statistics.median(recent)
