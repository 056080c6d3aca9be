"""Token-budget scheduling over the block pool. No torch: plain data in, plain data out.

Each request advances `num_computed_tokens` toward `num_tokens` (prompt plus the
tokens generated so far); a step gives it some of the budget:

    prompt  [p p p p p p p p p p]                num_tokens 10
    hit     [###### cached #####]                prefix cache: num_computed starts at 8
    step 1                      [p p]            the rest, samples token g0
    step 2                          [g0]         a decode: one token, samples g1

A prefill chunk, a prefix hit and a recompute after preemption are the same
thing seen from here: tokens not computed yet.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable, Mapping, Sequence

from engine.block_manager import BlockManager, LowerTier
from engine.config import EngineConfig, EngineLimits
from engine.request import QueueFullError, Request, RequestStatus
from engine.speculative import Speculator
from engine.stats import EngineStats
from engine.step import ScheduledRequest, SchedulerOutput

# Prompt rows a step computes logits of, for prompt logprobs, at most: each holds the whole
# vocabulary in float32 (256 rows of Qwen's 152k: 156 MB, and as much again for its log_softmax).
MAX_PROMPT_LOGPROB_ROWS = 256


class Scheduler:
    """The only writer of a request's status, timings and blocks: the engine core asks it."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        limits: EngineLimits,
        clock: Callable[[], float] = time.monotonic,
        windows: tuple[int | None, ...] = (None,),
        lower_tier: LowerTier | None = None,
    ):
        """windows: the model's KV cache groups; lower_tier: the prefix cache's tier below memory
        (both: see engine/block_manager.py)."""
        self.config = config
        self.limits = limits
        self.clock = clock
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, windows, lower_tier
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.speculator = Speculator(config.speculative) if config.speculative is not None else None

    # ------------------------------------------------------------ admission
    def add_request(self, request: Request) -> None:
        """Queue a request: ValueError if it can never be served or its id is in use,
        QueueFullError if max_num_seqs + max_waiting requests are already in flight."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.limits.check(request.prompt_token_ids, request.params.max_tokens)
        limit = self.limits.max_in_flight
        if limit is not None and len(self.requests) >= limit:
            raise QueueFullError(f"{len(self.requests)} requests already in flight (max_num_seqs + max_waiting)")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request of that id, if any."""
        return self.requests.get(request_id)

    def finish_request(self, request: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """End a request for any reason: out of the queues, its blocks freed, its final status set.

        A request that finished earlier in this step may be finished again: a stop string
        in the token that reached max_tokens wins over "length", and a request whose
        output could not be built ends in "error".
        """
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self.block_manager.free(request)
        request.status = status
        request.stop_reason = stop_reason

    def abort_request(self, request_id: str) -> Request | None:
        """End a request in any phase with "abort"; None if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_all(self, status: RequestStatus) -> list[Request]:
        """End every unfinished request with `status` (the engine stops, or cannot go on)."""
        requests = list(self.requests.values())
        for request in requests:
            self.finish_request(request, status)
        return requests

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []
        # Full blocks this step will compute: a waiting request whose prefix continues into
        # one of them waits a step and then reuses it instead of computing it again
        # (n samples of one prompt submitted together share the prompt this way).
        pending: set[int] = set()
        prompt_rows_left = MAX_PROMPT_LOGPROB_ROWS

        # Decodes first, then running prefill chunks: a long prompt never starves decodes.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        speculating = self._speculating(decodes)
        if speculating and self.speculator is not None:
            self.speculator.begin_step(len(decodes))
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if _wants_prompt_logprobs(request):
                num_new = _within_prompt_rows(request, request.num_computed_tokens, num_new, prompt_rows_left)
                if num_new == 0:
                    continue
                prompt_rows_left -= _num_prompt_rows(request, request.num_computed_tokens, num_new)
            drafts = self._drafts(request, budget) if request in speculating else []
            tables = bm.append_slots(request, request.num_computed_tokens + num_new + len(drafts))
            if tables is None and drafts and self.speculator is not None:  # drafts go before anyone is preempted
                self.speculator.stats.num_cut_by_budget += len(drafts)
                drafts = []
                tables = bm.append_slots(request, request.num_computed_tokens + num_new)
            while tables is None:
                victim = self.running[-1]  # the most recently admitted
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    budget += len(undone.token_ids)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                tables = bm.append_slots(request, request.num_computed_tokens + num_new)
            if tables is None:
                continue
            scheduled[request.request_id] = self._scheduled(request, num_new, tables, drafts)
            pending.update(bm.hashes_to_cache(request, request.num_computed_tokens + num_new))
            budget -= num_new + len(drafts)

        # Then waiting requests, first come first served. After a preemption the pool is
        # tight: admitting more would only preempt again.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            # Prompt logprobs need the logits of every prompt position, which a prefix hit would
            # skip: until its first token is out, such a request computes its whole prompt (as vLLM).
            if _wants_prompt_logprobs(request):
                hits = []
            else:
                hits = bm.get_computed_blocks(request)
                if bm.next_block_hash(request, len(hits[0])) in pending:
                    break
            num_hit_tokens = len(hits[0]) * bm.block_size if hits else 0
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if _wants_prompt_logprobs(request):
                num_new = _within_prompt_rows(request, 0, num_new, prompt_rows_left)
                if num_new == 0:
                    break
            tables = bm.allocate(request, hits, num_hit_tokens + num_new)
            if tables is None:
                break
            if _wants_prompt_logprobs(request):
                prompt_rows_left -= _num_prompt_rows(request, 0, num_new)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
            request.num_computed_tokens = num_hit_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            scheduled[request.request_id] = self._scheduled(request, num_new, tables)
            pending.update(bm.hashes_to_cache(request, num_hit_tokens + num_new))
            budget -= num_new

        return SchedulerOutput(
            scheduled=list(scheduled.values()),
            preempted=preempted,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
        )

    def _speculating(self, decodes: list[Request]) -> set[Request]:
        """The decodes that may carry drafts this step: none while more requests run than the batch
        size where speculation stops paying. Requests waiting to be admitted do not stop it (they
        wait for a free sequence or KV blocks, and drafts shorten the runs that hold those; a draft
        that finds no block is dropped before anyone is preempted, and prefills take the token
        budget after the decodes and their drafts, at most k a decode)."""
        if self.speculator is None or len(self.running) > self.speculator.config.max_batch_size:
            return set()
        return set(decodes)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Drafts for a decode: within the step's token budget, and such that the whole run
        (drafts plus one token) stays within max_tokens and the context."""
        if self.speculator is None:
            return []
        limit = min(
            budget - 1,
            request.params.max_tokens - request.num_output_tokens - 1,
            self.limits.max_model_len - request.num_tokens - 1,
            self.speculator.config.num_speculative_tokens,
        )
        return self.speculator.propose(request, limit)[:limit] if limit > 0 else []

    def _scheduled(
        self, request: Request, num_new: int, tables: list[list[int]], drafts: Sequence[int] = ()
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        prompt_logprob_rows = range(0)
        if _wants_prompt_logprobs(request):
            # Row j gives prompt token start + j + 1; the prompt's last row samples instead:
            #   prompt   t0 t1 t2 t3 t4 t5      chunk start 2, 4 tokens: rows of t2 t3 t4 t5
            #   rows           r0 r1 r2 (r3)    r0..r2 give t3..t5, r3 samples
            prompt_logprob_rows = range(_num_prompt_rows(request, start, num_new))
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new] + list(drafts),
            draft_token_ids=list(drafts),
            start_position=start,
            block_tables=[list(t) for t in tables],
            samples=start + num_new == request.num_tokens,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=request.generator,
            token_history=request.token_history,
            grammar=request.grammar,
            prompt_logprob_rows=prompt_logprob_rows,
        )

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it first in line; it is recomputed later,
        its generated tokens included (they are part of all_token_ids)."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # --------------------------------------------------------------- update
    def update(self, output: SchedulerOutput, sampled: Mapping[str, list[int]]) -> list[tuple[Request, int]]:
        """Advance the scheduled requests after the model ran.

        `sampled` maps request id -> the tokens sampled for it: one, or after drafts the
        accepted drafts and one token of its own (requests that sample and are missing had
        their sampling fail; the engine finishes them). The tokens are taken one by one and
        stops checked after each: what follows a stop is dropped. Returns the requests that
        got new tokens, with how many, finished ones included (already out of the scheduler,
        their blocks freed).
        """
        progressed = []
        now = self.clock()
        for s in output.scheduled:
            request = self.requests.get(s.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished while the step ran (abort, error)
            num_drafts = len(s.draft_token_ids)
            run = sampled.get(s.request_id) if s.samples else None
            # KV is valid for the tokens computed but the drafts, and for the drafts accepted.
            num_accepted = len(run) - 1 if run else 0
            request.num_computed_tokens += len(s.token_ids) - num_drafts + num_accepted
            if self.speculator is not None and run:
                self.speculator.record(request, num_drafts, num_accepted)
            num_new, stop = 0, None
            for token_id in run or ():
                request.append_output(token_id, now)
                num_new += 1
                status, stop_reason = self._check_stop(request, token_id)
                if status is not None:
                    stop = status, stop_reason
                    break
            # (Tokens after a stop were computed but are not the request's: not cached.)
            self.block_manager.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
            if stop is not None:
                self.finish_request(request, *stop)
            if num_new:
                progressed.append((request, num_new))
        return progressed

    def _check_stop(self, request: Request, token_id: int) -> tuple[RequestStatus | None, int | None]:
        params = request.params
        grammar = request.grammar
        if grammar is not None and not grammar.accept(token_id):
            return RequestStatus.FINISHED_ERROR, None  # only if no token was allowed at all
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
        if grammar is not None and grammar.is_done:  # only EOS could follow: end here, a step early
            return RequestStatus.FINISHED_STOPPED, None
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.limits.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    # ----------------------------------------------------------- accounting
    def stats(self) -> EngineStats:
        """The scheduler's part of the engine's stats; EngineCore fills in its own counters."""
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_kv_blocks_total=bm.num_usable_blocks,
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_cached=bm.num_cached_blocks,
            kv_block_size=bm.block_size,
            prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits,
            prefix_cache_disk_hits=bm.num_prefix_lower_tier_hits,
            num_preemptions=self.num_preemptions,
        )

    def lora_adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The LoRA adapters of the running requests and of the waiting ones, each sorted."""

        def names(requests: Iterable[Request]) -> tuple[str, ...]:
            return tuple(sorted({r.params.lora_name for r in requests if r.params.lora_name is not None}))

        return names(self.running), names(self.waiting)

    def save_cached_blocks(self) -> None:
        """Hand every cached block to the prefix cache's lower tier (at shutdown)."""
        self.block_manager.save_cached()

    def audit(self) -> list[str]:
        """Reconcile the block pool; one line per discrepancy (empty when consistent)."""
        return self.block_manager.audit()


def _wants_prompt_logprobs(request: Request) -> bool:
    """Prompt logprobs are asked and not yet delivered (they go out with the first token: a
    request preempted after it recomputes its prompt without them)."""
    return request.params.prompt_logprobs is not None and not request.output_token_ids


def _num_prompt_rows(request: Request, start: int, num_new: int) -> int:
    """Rows of a chunk of `num_new` tokens from `start` that give prompt logprobs (not the last
    prompt row, which samples)."""
    return max(0, min(num_new, request.num_prompt_tokens - 1 - start))


def _within_prompt_rows(request: Request, start: int, num_new: int, rows_left: int) -> int:
    """`num_new` cut so that the chunk's prompt-logprob rows fit in `rows_left` (0: none this step)."""
    if request.num_prompt_tokens - 1 - start <= rows_left:
        return num_new
    return min(num_new, rows_left)
