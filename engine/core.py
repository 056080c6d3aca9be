"""EngineCore: the synchronous step loop, schedule -> execute -> update -> outputs.

The scheduler owns every request's status, timings and blocks; the core asks it
(`finish_request`, `stats()`, `audit()`) and turns what it returns into outputs.
Single-threaded by design: AsyncEngine calls it from its own thread only, the
offline LLM class from the caller's. Failures are contained per request where
possible: a sampling or detokenizing error ends that request with "error"; a
forward pass that raises ends the requests of that batch; the engine serves on.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Sequence

from engine.config import EngineConfig, max_tokens_per_request
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_disk import DiskStore, KVDiskTier, model_fingerprint, payload_bytes
from engine.lora import LoRAInUseError, LoRANotFoundError
from engine.model_runner import ModelRunner
from engine.step import EngineDeadError
from engine.request import Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprob
from engine.scheduler import Scheduler
from engine.stats import EngineStats
from engine.structured import GrammarCompiler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.parallel import RankGroup
    from models.layers.lora import PreparedLoRA
    from models.loader import LoadedModel

logger = logging.getLogger(__name__)


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a prompt: text goes through the tokenizer exactly as its defaults say
    (special tokens such as BOS included when the checkpoint's tokenizer adds them)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    return [int(t) for t in prompt]


class EngineCore:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        ranks: RankGroup | None = None,
    ):
        """`ranks`: rank 0's engine.parallel.RankGroup when the model is split over several."""
        self.config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.clock = clock
        self.ranks = ranks
        self.runner = ModelRunner(loaded, self.config, ranks)
        windows = self.runner.kv_layout.windows
        capacity = None  # a pool without sliding groups: its tokens
        if any(w is not None for w in windows):
            capacity = max_tokens_per_request(
                windows,
                self.config.block_size,
                self.runner.num_blocks,
                self.config.max_num_batched_tokens,
                self.runner.max_model_len,
            )
        self.limits = self.config.limits(
            self.runner.max_model_len, self.runner.num_blocks, loaded.config.vocab_size, capacity
        )
        self.kv_disk = self._open_disk_tier(loaded)
        tier = None
        if self.kv_disk is not None:
            tier = KVDiskTier(self.kv_disk, self.runner.kv_caches, self.runner.kv_layout)
        self.scheduler = Scheduler(self.config, self.runner.num_blocks, self.limits, clock, windows, tier)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # request id -> its prompt logprobs so far, by prompt position (chunks fill them in; a
        # recompute after preemption writes the same again); sent with its first token.
        self._prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        # Compiled in the caller's thread (AsyncEngine compiles before it submits: a hit here).
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.num_steps = 0
        self.num_failed_steps = 0
        self.num_audit_discrepancies = 0
        self.num_prompt_tokens = 0
        self.num_structured_requests = 0
        self.num_generation_tokens = 0
        self.num_computed_tokens = 0
        self.num_finished: Counter[str] = Counter()
        self.num_lora_requests: Counter[str] = Counter()  # adapter name -> requests added, since start

    def _open_disk_tier(self, loaded: LoadedModel) -> DiskStore | None:
        """The prefix cache's disk tier, if configured (DiskTierLockedError, a ValueError, when
        another process holds its directory)."""
        directory = self.config.kv_cache_disk
        if directory is None:
            return None
        if self.ranks is not None:
            raise ValueError("kv_cache_disk is not supported under tensor parallelism")
        runner = self.runner
        fingerprint = model_fingerprint(loaded, runner.kv_cache_spec, runner.kv_layout, self.config.block_size)
        store = DiskStore(
            directory,
            self.config.kv_cache_disk_bytes,
            fingerprint,
            payload_bytes(runner.kv_caches, runner.kv_layout),
        )
        stats = store.stats()
        logger.info(
            "KV cache disk tier: %s, up to %.2f GiB, %d files (%.2f GiB) there at start, %d bytes a block%s",
            stats.directory,
            stats.max_bytes / 2**30,
            stats.num_files,
            stats.num_bytes / 2**30,
            store.file_bytes,
            "" if stats.enabled else " (off)",
        )
        return store

    def close(self) -> None:
        """Write the prefix cache's blocks to the disk tier, if any, and let it go; stop the other
        tensor-parallel ranks, if any (idempotent)."""
        if self.kv_disk is not None:
            self.scheduler.save_cached_blocks()
            self.kv_disk.close()
            self.kv_disk = None
        if self.ranks is not None:
            self.ranks.shutdown()

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; ValueError if it can never fit (self.limits), QueueFullError if the queue is full."""
        if params.lora_name is not None and params.lora_name not in self.runner.lora_slots:
            raise LoRANotFoundError(f"unknown LoRA adapter {params.lora_name!r}: none of that name is loaded")
        prompt_token_ids = tokenize_prompt(self.tokenizer, prompt)
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids=self.model_config.eos_token_ids,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            generator=self.runner.make_generator(params.seed),
            token_history=self.runner.make_token_history(params),
            grammar=self.grammars.compile(params.structured).matcher() if params.structured else None,
            lora_cache_key=self.runner.lora.cache_key(params.lora_name),
        )
        self.scheduler.add_request(request)
        if params.lora_name is not None:
            self.num_lora_requests[params.lora_name] += 1
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None] * len(prompt_token_ids)
        self.num_prompt_tokens += len(prompt_token_ids)
        self.num_structured_requests += params.structured is not None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request in any phase; its final output, or None if it is unknown or done."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        return self._final_output(request, self._flush(request_id))

    def load_lora_adapter(self, prepared: PreparedLoRA) -> None:
        """Install an adapter the runner prepared (ModelRunner.prepare_lora): between steps, as
        everything the core does; the requests already running are untouched."""
        self.runner.install_lora(prepared)

    def unload_lora_adapter(self, name: str) -> None:
        """Free an adapter's slot: LoRANotFoundError if none of that name is loaded, LoRAInUseError
        while one of its requests is running or waiting (it is never taken from under them)."""
        running, waiting = self.scheduler.lora_adapters()
        if name in running or name in waiting:
            raise LoRAInUseError(
                f"LoRA adapter {name!r} has running or waiting requests; unload it once they have finished"
            )
        self.runner.remove_lora(name)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        try:
            scheduler_output = self.scheduler.schedule()
        except Exception as e:  # a scheduler bug: end everything rather than spin on it
            logger.exception("scheduling failed; ending every request")
            return self.fail_all(f"scheduling failed: {type(e).__name__}: {e}")
        start = time.perf_counter()
        try:
            result = self.runner.execute(scheduler_output)
        except EngineDeadError:
            self.num_failed_steps += 1
            raise  # the ranks cannot go on: the engine stops (AsyncEngine ends every stream)
        except Exception as e:
            self.num_failed_steps += 1
            logger.exception(
                "forward pass failed; ending the %d requests of this batch", len(scheduler_output.scheduled)
            )
            message = f"model forward failed: {type(e).__name__}: {e}"
            outputs = []
            for s in scheduler_output.scheduled:
                outputs += self._fail(s.request_id, message)
            self._maybe_audit()
            return outputs
        seconds = time.perf_counter() - start
        self.num_computed_tokens += scheduler_output.num_batched_tokens
        speculator = self.scheduler.speculator
        if speculator is not None and all(
            len(s.token_ids) == 1 + len(s.draft_token_ids) for s in scheduler_output.scheduled
        ):
            speculator.observe_step(len(scheduler_output.scheduled), scheduler_output.num_batched_tokens, seconds)
        for request_id, (start, logprobs) in result.prompt_logprobs.items():
            collected = self._prompt_logprobs.get(request_id)
            if collected is not None:
                collected[start : start + len(logprobs)] = logprobs
        outputs = []
        for request_id, message in result.errors.items():
            outputs += self._fail(request_id, message)
        for request, num_new in self.scheduler.update(scheduler_output, result.sampled):
            try:
                output = self._tokens_output(request, num_new, result.logprobs.get(request.request_id))
            except Exception as e:  # noqa: BLE001 - e.g. the detokenizer; this request only
                logger.exception("output processing failed for request %s", request.request_id)
                self.num_generation_tokens += num_new
                outputs.append(self._error_output(request, f"{type(e).__name__}: {e}"))
                continue
            self.num_generation_tokens += len(output.token_ids)
            outputs.append(output)
        self._maybe_audit()
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        finished = self.scheduler.finish_all(RequestStatus.FINISHED_ERROR)
        return [self._error_output(request, message) for request in finished]

    def abort_all(self) -> list[RequestOutput]:
        finished = self.scheduler.finish_all(RequestStatus.FINISHED_ABORTED)
        return [self._final_output(request, self._flush(request.request_id)) for request in finished]

    def _tokens_output(self, request: Request, num_new: int, logprobs: list | None) -> RequestOutput:
        """The output for a request's `num_new` new tokens (more than one after accepted drafts),
        detokenized one by one: a stop string ends the request at the token that completes it,
        and the tokens after it are taken back (text, usage and logprobs alike)."""
        token_ids = request.output_token_ids[-num_new:]
        logprobs = list(logprobs[:num_new]) if request.params.logprobs is not None and logprobs else None
        detokenizer = self._detokenizers[request.request_id]
        text = ""
        for i, token_id in enumerate(token_ids):
            last = i == len(token_ids) - 1
            if (
                last
                and request.status is RequestStatus.FINISHED_STOPPED
                and (token_id in request.eos_token_ids or token_id == request.stop_reason)
            ):
                # Ended by EOS or a stop token id: that token's text stays out of the output.
                text += self._flush(request.request_id)
                break
            piece, stop_string = detokenizer.append(token_id)
            text += piece
            if stop_string is not None:
                # A stop string wins over length reached on the same token.
                request.drop_last_outputs(len(token_ids) - 1 - i)
                token_ids, logprobs = token_ids[: i + 1], logprobs[: i + 1] if logprobs else logprobs
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, stop_string)
                self._detokenizers.pop(request.request_id, None)
                break
            if last and request.status.is_finished:
                text += self._flush(request.request_id)
        if request.status.is_finished:
            error = "the output left its grammar" if request.status is RequestStatus.FINISHED_ERROR else None
            return self._final_output(request, text, token_ids, logprobs, error)
        return self._output(request, text, token_ids, logprobs)

    def _fail(self, request_id: str, message: str) -> list[RequestOutput]:
        """End an unfinished request with finish_reason "error" (nothing if it is already gone)."""
        request = self.scheduler.get_request(request_id)
        return [self._error_output(request, message)] if request is not None else []

    def _error_output(self, request: Request, message: str) -> RequestOutput:
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
        self._detokenizers.pop(request.request_id, None)
        return self._final_output(request, "", error=message)

    def _flush(self, request_id: str) -> str:
        detokenizer = self._detokenizers.pop(request_id, None)
        return detokenizer.flush() if detokenizer is not None else ""

    def _final_output(
        self,
        request: Request,
        text: str,
        token_ids: Sequence[int] = (),
        logprobs: list[TokenLogprob] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        reason = request.status.finish_reason
        assert reason is not None  # the request has finished
        self.num_finished[reason] += 1
        return self._output(request, text, list(token_ids), logprobs, error)

    def _output(
        self,
        request: Request,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        error: str | None = None,
    ) -> RequestOutput:
        first_scheduled, first_token = request.first_scheduled_time, request.first_token_time
        prompt_logprobs = None
        if request.num_output_tokens or request.status.is_finished:
            prompt_logprobs = self._prompt_logprobs.pop(request.request_id, None)
            if not request.num_output_tokens:  # ended before its prompt was computed
                prompt_logprobs = None
        return RequestOutput(
            request_id=request.request_id,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finished=request.status.is_finished,
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            error=error,
            queue_time=(first_scheduled - request.arrival_time) if first_scheduled is not None else 0.0,
            prefill_time=(first_token - first_scheduled)
            if first_token is not None and first_scheduled is not None
            else 0.0,
            decode_time=(request.last_token_time - first_token)
            if first_token is not None and request.last_token_time is not None
            else 0.0,
            stop_reason=request.stop_reason,
            prompt_logprobs=prompt_logprobs,
        )

    # --------------------------------------------------------- accounting
    def audit(self) -> list[str]:
        return self.scheduler.audit()

    def _maybe_audit(self) -> None:
        interval = self.config.audit_interval_steps
        if not interval or self.num_steps % interval:
            return
        try:
            issues = self.audit()
        except Exception:  # noqa: BLE001 - the audit must never take the engine down
            logger.exception("KV block audit raised")
            issues = ["audit raised"]
        if issues:
            self.num_audit_discrepancies += len(issues)
            logger.error("KV block audit at step %d: %s", self.num_steps, "; ".join(issues[:20]))

    def stats(self) -> EngineStats:
        return replace(
            self.scheduler.stats(),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_computed_tokens=self.num_computed_tokens,
            num_steps=self.num_steps,
            num_failed_steps=self.num_failed_steps,
            num_audit_discrepancies=self.num_audit_discrepancies,
            num_finished=dict(self.num_finished),
            num_grammars_compiled=self.grammars.num_compiled,
            speculative=self.scheduler.speculator.snapshot() if self.scheduler.speculator is not None else None,
            num_structured_requests=self.num_structured_requests,
            weight_bytes=self.runner.weight_bytes,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            step_totals=self.runner.step_totals(),
            kv_disk=self.kv_disk.stats() if self.kv_disk is not None else None,
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        if not self.runner.lora.max_loras:
            return {}
        running, waiting = self.scheduler.lora_adapters()
        return dict(
            max_loras=self.runner.lora.max_loras,
            running_lora_adapters=running,
            waiting_lora_adapters=waiting,
            num_lora_requests=dict(self.num_lora_requests),
        )
