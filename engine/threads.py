"""How a step runs on CPU: its kernels (oneDNN or not) by step size, its threads by timing.

  oneDNN            torch sends bf16/fp16 matmuls to oneDNN. For a single row (a step of
                    one decode: every weight read once for one token) torch's own
                    reduced-precision gemv, used with oneDNN off, is faster (about half the
                    time of a one-token step); from 2 rows on oneDNN
                    wins by a wide margin. So single-token steps run on
                    torch's kernels, always: a choice by timing would switch kernels between
                    steps, and with them the rounding of bf16 results, so that one seeded
                    request could sample differently from one run to the next. The choice
                    is a StepKernels that the step carries to the layers
                    (models/layers/step_kernels.py), not a switch of torch's.
  intra-op threads  On a quiet machine a step is fastest with every core in torch's
                    OpenMP team. On a busy one (other processes, or our own event loop and
                    a load generator on the same box) a team thread is often descheduled,
                    and the others wait for it at the barrier that ends every parallel op:
                    on 2 shared cores, 2 threads can be several times slower than 1, and
                    at a quieter moment faster. So the count is chosen by timing, where
                    results do not depend on it: when the model is row-invariant
                    (CausalLM.row_invariant: quantized linear layers, whose kernel splits
                    work across output rows and columns, never across a sum, or dense ones
                    under --batch-invariant, on rows_matmul) and our CPU kernels serve
                    attention and the rest. A model with dense linear layers otherwise
                    runs them on torch's GEMMs, where for some row counts the thread count
                    changes a row's rounding (MKL float32: docs/determinism.md):
                    its steps keep one count, all the cores (or --num-threads).

The tuner:

    step shape      bucket = number of tokens rounded up to a power of two
    per (bucket, s) median seconds per token of the last 3 steps run with setting s
    each step       the best setting: at first the candidates' first (most threads); another
                    replaces it when both have 3 timed steps and its median is at least
                    `margin` (10%) lower. Without the margin (the lowest median of however
                    many steps won), noise flipped the count: decodes whose median was 30%
                    slower on 1 thread still ran a tenth of their steps on it, dozens in a row
    first steps     each candidate once, in order; then the best until it has 3 timed steps
    re-checks       every `recheck_every` steps of a bucket, another candidate runs once,
                    less often the worse it did (its time ratio, at most 4, x recheck_every),
                    and again at once while its last run beats the best's median by the
                    margin, so that 2 good runs move its median
    costly steps    a step that would take more than `explore_seconds` (0.2 s) with the
                    bucket's best tries another setting (first steps, re-checks) only where
                    a smaller bucket runs best with it (the cores are contended). Timing a
                    costly size on fewer threads is a bet of seconds: a long prompt step on
                    1 thread of 2 takes about twice as long, and a run of 16 streams lost a
                    quarter of its throughput to such tries
"""

from __future__ import annotations

import statistics
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple

import torch

from models.layers.step_kernels import DEFAULT_KERNELS, StepKernels, onednn_takes


class StepSetting(NamedTuple):
    num_threads: int
    kernels: StepKernels = DEFAULT_KERNELS  # what the layers run; goes with the step's metadata


def candidate_settings(
    cores: int, fixed_threads: int | None, dtype: torch.dtype, row_invariant: bool = True
) -> Callable[[int], tuple[StepSetting, ...]]:
    """The settings worth timing for a step of `num_tokens` tokens, most threads first.
    `row_invariant`: whether results are the same whatever the thread count (see above)."""
    if fixed_threads is None and not row_invariant:
        fixed_threads = cores
    counts = (fixed_threads,) if fixed_threads is not None else tuple(sorted({cores, max(cores - 1, 1)}, reverse=True))
    single_token = StepKernels(onednn=False) if onednn_takes(dtype) else DEFAULT_KERNELS

    def candidates(num_tokens: int) -> tuple[StepSetting, ...]:
        kernels = single_token if num_tokens == 1 else DEFAULT_KERNELS
        return tuple(StepSetting(n, kernels) for n in counts)

    return candidates


@contextmanager
def applied(setting: StepSetting) -> Iterator[None]:
    """Run the block with the setting's thread count, then put the caller's back. torch
    keeps the count per thread, so it is set around the step, not passed to the layers
    (as the setting's kernels are)."""
    threads = torch.get_num_threads()
    if setting.num_threads != threads:
        torch.set_num_threads(setting.num_threads)
    try:
        yield
    finally:
        if setting.num_threads != threads:  # torch's count is also the default of new threads
            torch.set_num_threads(threads)


class StepTotals(NamedTuple):
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0


class StepTuner:
    def __init__(
        self,
        candidates: Callable[[int], tuple[StepSetting, ...]],
        recheck_every: int = 50,
        window: int = 3,
        margin: float = 0.1,
        explore_seconds: float = 0.2,
    ):
        if recheck_every < 1 or window < 1:
            raise ValueError(f"recheck_every and window must be at least 1, got {recheck_every}, {window}")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        self.candidates = candidates
        self.recheck_every = recheck_every
        self.window = window
        self.margin = margin
        self.explore_seconds = explore_seconds
        self._seconds_per_token: dict[tuple[int, StepSetting], deque[float]] = {}
        self._num_steps: dict[int, int] = {}  # bucket -> steps chosen for it
        self._next_check: dict[int, int] = {}  # bucket -> step count at which to re-check
        self._best: dict[int, StepSetting] = {}  # bucket -> the setting its steps run with (see above)
        self._totals: dict[int, StepTotals] = {}  # thread count -> what ran with it, since start

    def totals(self) -> dict[int, StepTotals]:
        """Steps, tokens and seconds run with each thread count since start (what the tuner chose,
        and what it cost: /metrics shows it, so an operator sees where a step's time went)."""
        return dict(self._totals)

    def _bucket_candidates(self, num_tokens: int) -> tuple[StepSetting, ...]:
        candidates = self.candidates(num_tokens)
        if not candidates or min(s.num_threads for s in candidates) < 1:
            raise ValueError(f"step settings must have positive thread counts, got {candidates}")
        return candidates

    def choose(self, num_tokens: int) -> StepSetting:
        """The setting to run a step of `num_tokens` tokens with."""
        candidates = self._bucket_candidates(num_tokens)
        bucket = num_tokens.bit_length()
        step = self._num_steps[bucket] = self._num_steps.get(bucket, 0) + 1
        best = self._best.get(bucket, candidates[0])
        untimed = [s for s in candidates if (bucket, s) not in self._seconds_per_token]
        if untimed and (untimed[0] == best or self._may_try(bucket, num_tokens, untimed[0])):
            return untimed[0]
        if (
            len(candidates) == 1
            or not self._full(bucket, best)
            or step < self._next_check.setdefault(bucket, step + self.recheck_every)
        ):
            return best
        others = [s for s in candidates if s != best]
        other = others[step % len(others)]
        if (bucket, other) not in self._seconds_per_token:  # never timed here: costly, not tried (above)
            self._next_check[bucket] = step + self.recheck_every
            return best
        ratio = self._median(bucket, other) / self._median(bucket, best)
        # Capped: a setting that did badly while neighbours were busy must get another chance.
        self._next_check[bucket] = step + int(self.recheck_every * min(max(1.0, ratio), 4.0))
        return other if self._may_try(bucket, num_tokens, other) else best

    def _may_try(self, bucket: int, num_tokens: int, setting: StepSetting) -> bool:
        """Whether a step of `num_tokens` may run with `setting` to time it (module docstring,
        costly steps): the bucket's best would take at most explore_seconds, or a smaller
        bucket's steps run best with `setting`."""
        best = self._best.get(bucket)
        if best is None or (bucket, best) not in self._seconds_per_token:
            return True
        if self._median(bucket, best) * num_tokens <= self.explore_seconds:
            return True
        return any(b < bucket and s == setting for b, s in self._best.items())

    def record(self, num_tokens: int, setting: StepSetting, seconds: float) -> StepSetting | None:
        """How long a step chosen by `choose(num_tokens)` took with `setting`; returns the
        new best setting for steps of that size when this changed it."""
        bucket = num_tokens.bit_length()
        steps, tokens, total = self._totals.get(setting.num_threads, StepTotals())
        self._totals[setting.num_threads] = StepTotals(steps + 1, tokens + num_tokens, total + seconds)
        times = self._seconds_per_token.setdefault((bucket, setting), deque(maxlen=self.window))
        times.append(seconds / max(num_tokens, 1))
        candidates = self.candidates(num_tokens)
        previous = self._best.get(bucket)
        best = previous if previous is not None else candidates[0]
        if self._full(bucket, best):
            bar = (1 - self.margin) * self._median(bucket, best)
            full = [s for s in candidates if s != best and self._full(bucket, s)]
            challenger = min(full, key=lambda s: self._median(bucket, s), default=None)
            if challenger is not None and self._median(bucket, challenger) < bar:
                best = challenger
                bar = (1 - self.margin) * self._median(bucket, best)
            others = [s for s in candidates if s != best and (bucket, s) in self._seconds_per_token]
            if any(self._seconds_per_token[(bucket, s)][-1] < bar for s in others):
                self._next_check[bucket] = 0  # its last run beat the best by the margin: run it again
        self._best[bucket] = best
        return best if previous is not None and best != previous else None

    def _full(self, bucket: int, setting: StepSetting) -> bool:
        return len(self._seconds_per_token.get((bucket, setting), ())) == self.window

    def _median(self, bucket: int, setting: StepSetting) -> float:
        return statistics.median(self._seconds_per_token[(bucket, setting)])
