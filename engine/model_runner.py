"""SchedulerOutput -> flat tensors -> one model forward -> logits of sampling rows -> tokens.

All scheduled requests go through the model together, prefill chunks and
decodes alike, laid out flat, request after request:

    scheduled   A: 5 prompt tokens (samples)   B: decode   C: chunk of 4 (does not sample)
    input_ids   [a0 a1 a2 a3 a4 | b9 | c0 c1 c2 c3]
    positions   [ 0  1  2  3  4 |  9 |  0  1  2  3]
    rows that produce a token:  4 (A's last), 5 (B's)      -> compute_logits on 2 rows only
"""
from __future__ import annotations

import logging
import time

import torch

from engine.config import EngineConfig
from engine.sampler import SamplingBatch, TokenHistory, make_generator, sample
from engine.step import RunnerOutput, ScheduledRequest, SchedulerOutput
from engine.threads import StepTuner, applied, candidate_settings
from models.layers import cpu_kernels
from models.layers.attention import AttentionMetadata
from models.layers.step_kernels import DEFAULT_KERNELS, StepKernels

logger = logging.getLogger(__name__)


def resolve_kv_cache_dtype(name: str, loaded) -> torch.dtype:
    """EngineConfig.kv_cache_dtype -> the cache's torch dtype (see there)."""
    if name != "auto":
        return getattr(torch, name)
    if loaded.config.dtype == torch.float32 and loaded.is_quantized:
        return torch.float16
    return loaded.config.dtype


class ModelRunner:
    def __init__(self, loaded, config: EngineConfig):
        self.model = loaded.model
        self.model_config = loaded.config
        self.block_size = config.block_size
        self.device = next(self.model.parameters()).device
        self.max_model_len = config.resolve_max_model_len(loaded.config.max_model_len)
        self.kv_cache_spec = self.model.kv_cache_spec(resolve_kv_cache_dtype(config.kv_cache_dtype, loaded))
        bytes_per_token = self.kv_cache_spec.bytes_per_token
        self.num_blocks = config.resolve_num_blocks(bytes_per_token, self.max_model_len)
        self.kv_caches = self.kv_cache_spec.allocate(self.num_blocks, self.block_size, self.device)
        self.kv_cache_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        self.weight_bytes = loaded.weight_bytes
        # CPU: intra-op threads (chosen by timing steps unless configured, or unless results
        # would depend on the count), set for each step in whichever thread runs it and the
        # caller's put back after, and the step's kernels (torch's own for single-token steps),
        # passed to the model with the step (engine/threads.py).
        self.step_tuner = None
        if self.device.type == "cpu":
            row_invariant = cpu_kernels.available() and self.model.row_invariant()  # builds (or loads) them now
            candidates = candidate_settings(
                torch.get_num_threads(), config.num_threads, loaded.config.dtype, row_invariant
            )
            self.step_tuner = StepTuner(candidates)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %d bytes per token, %.3f GiB (%s, %s)",
            self.num_blocks, self.block_size, self.num_tokens_capacity, bytes_per_token,
            self.num_tokens_capacity * bytes_per_token / 2**30, self.kv_cache_spec.dtype, self.device,
        )

    @property
    def num_tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def make_generator(self, seed: int | None) -> torch.Generator | None:
        return make_generator(seed, self.device)

    def make_token_history(self, params) -> TokenHistory | None:
        """A request's penalty cache, kept across its steps; None when it has no penalty."""
        if params.repetition_penalty == 1.0 and params.frequency_penalty == 0 and params.presence_penalty == 0:
            return None
        return TokenHistory(self.device)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Run one step. A failure of the forward pass raises (the whole batch is lost);
        a failure while sampling one request is reported in RunnerOutput.errors."""
        scheduled = output.scheduled
        if not scheduled:
            return RunnerOutput()
        num_tokens = output.num_batched_tokens
        if self.step_tuner is None:
            return self._execute(scheduled, DEFAULT_KERNELS)
        setting = self.step_tuner.choose(num_tokens)
        with applied(setting):
            start = time.perf_counter()
            result = self._execute(scheduled, setting.kernels)
            seconds = time.perf_counter() - start
        best = self.step_tuner.record(num_tokens, setting, seconds)
        if best is not None:
            logger.debug("steps of about %d tokens now run with %s", num_tokens, best)
        return result

    def _execute(self, scheduled: list[ScheduledRequest], kernels: StepKernels) -> RunnerOutput:
        hidden = self._forward(scheduled, kernels)  # (num_tokens, hidden_size)
        ends, offset = [], 0
        for s in scheduled:
            offset += len(s.token_ids)
            ends.append(offset - 1)
        samplers = [(s, end) for s, end in zip(scheduled, ends) if s.samples]
        if not samplers:
            return RunnerOutput()
        if len(samplers) < hidden.shape[0]:  # prefill chunks: only their last rows sample
            rows = torch.tensor([end for _, end in samplers], dtype=torch.int64, device=hidden.device)
            hidden = hidden[rows]  # (num_samplers, hidden_size)
        logits = self.model.compute_logits(hidden, kernels)  # (num_samplers, vocab) float32
        return self._sample(logits, [s for s, _ in samplers])

    def _forward(self, scheduled: list[ScheduledRequest], kernels: StepKernels) -> torch.Tensor:
        query_lens = [len(s.token_ids) for s in scheduled]
        seq_lens = [s.start_position + len(s.token_ids) for s in scheduled]
        positions = [p for s in scheduled for p in range(s.start_position, s.start_position + len(s.token_ids))]
        # One host tensor for both inputs: a step of decodes is small, so per-call overhead counts.
        inputs = torch.tensor(
            [[t for s in scheduled for t in s.token_ids], positions], dtype=torch.int64, device=self.device
        )  # (2, num_tokens): input ids, positions
        meta = AttentionMetadata.build(
            query_lens, seq_lens, [s.block_table for s in scheduled], self.block_size, self.device, kernels
        )
        return self.model(inputs[0], inputs[1], self.kv_caches, meta)

    def _sample(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> RunnerOutput:
        # The batch attempt may fail after seeded generators drew: the retry starts them
        # where they were, so a seeded request's tokens do not depend on a neighbour failing.
        generators = [s.generator for s in requests if s.generator is not None]
        states = [g.get_state() for g in generators]
        try:
            return self._sample_rows(logits, requests)
        except Exception:
            logger.exception("sampling failed for a batch of %d; retrying row by row", len(requests))
        for generator, state in zip(generators, states):
            generator.set_state(state)
        # One bad request must not cost the others their token: sample each row alone. A
        # failure is that request's error, never the step's (which would end the whole batch).
        result = RunnerOutput()
        for i, request in enumerate(requests):
            try:
                one = self._sample_rows(logits[i : i + 1], [request])
            except Exception as e:  # noqa: BLE001 - reported as this request's error
                logger.exception("sampling failed for request %s", request.request_id)
                result.errors[request.request_id] = f"sampling failed: {type(e).__name__}: {e}"
                continue
            result.sampled.update(one.sampled)
            result.logprobs.update(one.logprobs)
        return result

    def _sample_rows(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> RunnerOutput:
        batch = SamplingBatch.from_params(
            [s.params for s in requests],
            [s.prompt_token_ids for s in requests],
            [s.output_token_ids for s in requests],
            [s.generator for s in requests],
            vocab_size=logits.shape[-1],
            device=logits.device,
            eos_token_ids=self.model_config.eos_token_ids,
            histories=[s.token_history for s in requests],
            grammars=[s.grammar for s in requests],
        )
        out = sample(logits, batch)
        vocab_size = logits.shape[-1]
        bad = [(s.request_id, t) for s, t in zip(requests, out.token_ids) if not 0 <= t < vocab_size]
        if bad:  # fed back into the next forward, it would fail the whole batch there
            raise ValueError(f"sampled token ids {bad} are outside the vocabulary (size {vocab_size})")
        return RunnerOutput(
            sampled={s.request_id: t for s, t in zip(requests, out.token_ids)},
            logprobs={s.request_id: lp for s, lp in zip(requests, out.logprobs)},
        )
