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

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import QueueFullError, RequestStatus, SamplingParams  # noqa: F401 - QueueFullError re-exported


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    generator: object | None = None  # the sampler's per-request RNG; opaque here
    token_history: object | None = None  # the sampler's per-request penalty cache; opaque here
    grammar: object | None = None  # its structured output's GrammarMatcher (engine/structured.py)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # filled by the block manager
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)  # prompt + output, what the KV cache holds

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_position: int  # position of token_ids[0] (= num_computed_tokens before the step)
    block_table: list[int]
    samples: bool  # the chunk reaches the end of the request: sample its next token
    # What the sampler needs for this request (plain Python; the runner makes tensors).
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: object | None
    token_history: object | None = None
    grammar: object | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[str]  # request ids sent back to the waiting queue this step
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ------------------------------------------------------------ admission
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError for a request that could never be served."""
        if num_prompt_tokens < 1:
            raise ValueError("the prompt is empty")
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) is {total} "
                f"tokens, more than the model's context length of {self.max_model_len}"
            )
        bm = self.block_manager
        if bm.blocks_needed(total) > bm.num_blocks:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{bm.blocks_needed(total)} KV blocks, more than the whole cache of {bm.num_blocks} "
                f"blocks ({bm.num_blocks * bm.block_size} tokens)"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_request(request.num_prompt_tokens, request.params)
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests already waiting (max_waiting)")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_request(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> Request | None:
        """End a request in any phase and free its blocks; None if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        request.stop_reason = stop_reason
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

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

        # Decodes first, then running prefill chunks: a long prompt never starves decodes.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            table = bm.append_slots(request, request.num_computed_tokens + num_new)
            while table is None:
                victim = self.running[-1]  # the most recently admitted
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    budget += len(undone.token_ids)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                table = bm.append_slots(request, request.num_computed_tokens + num_new)
            if table is None:
                continue
            scheduled[request.request_id] = self._scheduled(request, num_new, table)
            pending.update(bm.hashes_to_cache(request, request.num_computed_tokens + num_new))
            budget -= num_new

        # Then waiting requests, first come first served. After a preemption the pool is
        # tight: admitting more would only preempt again.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = bm.get_computed_blocks(request)
            if bm.next_block_hash(request, len(hits)) in pending:
                break
            num_hit_tokens = len(hits) * bm.block_size
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            table = bm.allocate(request, hits, num_hit_tokens + num_new)
            if table is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            scheduled[request.request_id] = self._scheduled(request, num_new, table)
            pending.update(bm.hashes_to_cache(request, num_hit_tokens + num_new))
            budget -= num_new

        return SchedulerOutput(
            scheduled=list(scheduled.values()),
            preempted=preempted,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
        )

    def _scheduled(self, request: Request, num_new: int, table: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            start_position=start,
            block_table=list(table),
            samples=start + num_new == request.num_tokens,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=request.generator,
            token_history=request.token_history,
            grammar=request.grammar,
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
    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Request]:
        """Advance the scheduled requests after the model ran.

        `sampled` maps request id -> the token sampled for it (requests that sample and
        are missing had their sampling fail; the engine finishes them). Returns the
        requests that got a new token, finished ones included (already out of the
        scheduler, their blocks freed).
        """
        progressed = []
        for s in output.scheduled:
            request = self.requests.get(s.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished while the step ran (abort, error)
            request.num_computed_tokens += len(s.token_ids)
            self.block_manager.cache_blocks(request, request.num_computed_tokens)
            if not s.samples or s.request_id not in sampled:
                continue
            token_id = sampled[s.request_id]
            request.append_output(token_id)
            status, stop_reason = self._check_stop(request, token_id)
            if status is not None:
                self.finish_request(request.request_id, status, stop_reason)
            progressed.append(request)
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
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
