"""The intra-op thread count of the thread that runs the model, chosen by timing steps.

On a quiet machine a step is fastest with every core in torch's OpenMP team. On a
busy one (other processes, or our own event loop and a load generator on the same
box) a team thread is often descheduled, and the others wait for it at the barrier
that ends every parallel op. On 2 shared cores we measured steps of 64 decodes 3-10x
slower with 2 threads than with 1, and at a quieter moment 1.5x faster. Which case
holds changes as neighbours come and go, so the runner measures instead of guessing:

    step shape      bucket = number of tokens rounded up to a power of two
    per (bucket, n) median seconds per token of the last 3 steps run with n threads
    each step       the n with the lowest median; candidates never timed go first
    re-checks       every `recheck_every` steps of a bucket, another candidate runs once,
                    less often the worse it did (its time ratio, at most 4, x recheck_every),
                    and again at once if it now looks faster, so 2 good runs move the median
"""
from __future__ import annotations

import statistics
from collections import deque


class ThreadTuner:
    def __init__(self, candidates: tuple[int, ...], recheck_every: int = 50, window: int = 3):
        if not candidates or min(candidates) < 1:
            raise ValueError(f"thread candidates must be positive counts, got {candidates}")
        if recheck_every < 1 or window < 1:
            raise ValueError(f"recheck_every and window must be at least 1, got {recheck_every}, {window}")
        self.candidates = tuple(sorted(set(candidates), reverse=True))  # most threads first
        self.recheck_every = recheck_every
        self.window = window
        self._seconds_per_token: dict[tuple[int, int], deque[float]] = {}
        self._num_steps: dict[int, int] = {}  # bucket -> steps chosen for it
        self._next_check: dict[int, int] = {}  # bucket -> step count at which to re-check
        self._best: dict[int, int] = {}  # bucket -> thread count with the lowest median

    def choose(self, num_tokens: int) -> int:
        """Threads to run a step of `num_tokens` tokens with."""
        bucket = num_tokens.bit_length()
        step = self._num_steps[bucket] = self._num_steps.get(bucket, 0) + 1
        untimed = [n for n in self.candidates if (bucket, n) not in self._seconds_per_token]
        if untimed:
            return untimed[0]
        best = self._best[bucket]
        if len(self.candidates) == 1 or step < self._next_check.setdefault(bucket, step + self.recheck_every):
            return best
        others = [n for n in self.candidates if n != best]
        other = others[step % len(others)]
        ratio = self._median(bucket, other) / self._median(bucket, best)
        # Capped: a count that did badly while neighbours were busy must get another chance.
        self._next_check[bucket] = step + int(self.recheck_every * min(max(1.0, ratio), 4.0))
        return other

    def record(self, num_tokens: int, num_threads: int, seconds: float) -> int | None:
        """How long a step chosen by `choose(num_tokens)` took with `num_threads` threads;
        returns the new best count for steps of that size when this changed it."""
        bucket = num_tokens.bit_length()
        times = self._seconds_per_token.setdefault((bucket, num_threads), deque(maxlen=self.window))
        times.append(seconds / max(num_tokens, 1))
        timed = [n for n in self.candidates if (bucket, n) in self._seconds_per_token]
        best = min(timed, key=lambda n: self._median(bucket, n))
        previous = self._best.get(bucket)
        self._best[bucket] = best
        if previous is not None and num_threads != previous and times[-1] < self._median(bucket, previous):
            self._next_check[bucket] = 0  # looked faster once: run it again to confirm
        return best if previous is not None and best != previous else None

    def _median(self, bucket: int, num_threads: int) -> float:
        return statistics.median(self._seconds_per_token[(bucket, num_threads)])
