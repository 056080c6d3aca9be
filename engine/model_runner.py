"""SchedulerOutput -> flat tensors -> one model forward -> logits of sampling rows -> tokens.

All scheduled requests go through the model together, prefill chunks and
decodes alike, laid out flat, request after request:

    scheduled   A: 5 prompt tokens (samples)   B: decode   C: chunk of 4 (does not sample)
    input_ids   [a0 a1 a2 a3 a4 | b9 | c0 c1 c2 c3]
    positions   [ 0  1  2  3  4 |  9 |  0  1  2  3]
    rows that produce a token:  4 (A's last), 5 (B's)      -> compute_logits on 2 rows only

A request that asks for prompt logprobs adds its chunk's prompt rows (ScheduledRequest.
prompt_logprob_rows) to the rows whose logits are computed; nobody asking, nothing is added.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, cast

import torch

from engine.config import EngineConfig, max_blocks_per_request
from engine.sampler import TokenHistory, make_generator, prompt_logprobs
from engine.step import EngineDeadError, RunnerOutput, ScheduledRequest, SchedulerOutput, StepInputs
from engine.threads import StepTuner, applied, candidate_settings
from engine.verification import sample_requests
from models.kv_int8 import calibrate_int8_keys
from models.layers import cpu_kernels
from models.layers.attention import AttentionMetadata
from engine.lora import LoRASlots
from models.layers.lora import (
    PreparedLoRA,
    add_lora_adapters,
    prepare_lora_adapter,
    read_peft_adapter,
    remove_lora_adapter,
)
from models.layers.lora_weights import LoRABatch
from models.layers.step_kernels import DEFAULT_KERNELS, StepKernels

if TYPE_CHECKING:
    from engine.request import SamplingParams
    from models.causal_lm import CausalLM
    from models.loader import LoadedModel

logger = logging.getLogger(__name__)


class Ranks(Protocol):
    """What the runner needs of engine.parallel.RankGroup (which imports this module)."""

    def send(self, inputs: StepInputs | None) -> None: ...

    def load_lora(self, name: str, path: str, slot: int, max_rank: int) -> None: ...

    def remove_lora(self, name: str, slot: int) -> None: ...


def resolve_kv_cache_dtype(name: str, loaded: LoadedModel) -> torch.dtype:
    """EngineConfig.kv_cache_dtype -> the cache's torch dtype (see there)."""
    if name != "auto":
        return getattr(torch, name)
    if loaded.config.dtype == torch.float32 and loaded.is_quantized:
        return torch.float16
    return loaded.config.dtype


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, ranks: Ranks | None = None):
        """`ranks`: rank 0's engine.parallel.RankGroup under tensor parallelism (every step's
        inputs go to the other ranks first); None: one process."""
        self.ranks = ranks
        self.model = cast("CausalLM", loaded.model)  # every registered architecture is one
        self.model_config = loaded.config
        self.block_size = config.block_size
        self.device = next(self.model.parameters()).device
        self.max_model_len = config.resolve_max_model_len(loaded.config.max_model_len)
        self.kv_cache_spec = self.model.kv_cache_spec(resolve_kv_cache_dtype(config.kv_cache_dtype, loaded))
        if self.kv_cache_spec.dtype == torch.int8:  # keys stored with per-channel offsets and scales (every rank)
            calibrate_int8_keys(loaded)
        # Layers grouped by how they attend: a sliding group's tables drop what leaves its window.
        self.kv_layout = self.kv_cache_spec.layout(self.max_model_len)
        bytes_per_token = self.kv_cache_spec.bytes_per_entry * self.kv_layout.num_slots  # in one block id
        blocks_per_seq = max_blocks_per_request(
            self.kv_layout.windows, self.block_size, self.max_model_len, config.max_num_batched_tokens
        )
        self.num_blocks = config.resolve_num_blocks(bytes_per_token, self.max_model_len, blocks_per_seq)
        if any(w is not None for w in self.kv_layout.windows) and config.num_kv_blocks is None:
            self.num_blocks += 1  # the null block (engine/block_manager.py)
        self.kv_caches = self.kv_cache_spec.allocate(self.num_blocks, self.block_size, self.device, self.kv_layout)
        self.kv_cache_bytes = sum(c.numel() * c.element_size() for c in {id(c): c for c in self.kv_caches}.values())
        self.weight_bytes = loaded.weight_bytes
        # LoRA adapters: name -> slot in the layers (models/layers/lora.py); empty: none served.
        self.lora = LoRASlots(config.resolved_max_loras)
        self.lora_slots = self.lora.slots
        # an adapter's weights: the model's dtype (as PEFT loads them), or EngineConfig.lora_dtype's
        self.lora_dtype = loaded.config.dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        self.max_lora_rank = config.max_lora_rank
        if config.lora_modules:  # under tensor parallelism every rank attaches its part of each
            for name, slot in add_lora_adapters(
                self.model, dict(config.lora_modules), config.max_lora_rank, self.lora_dtype
            ).items():
                assert self.lora.add(name) == slot  # both number them 1.. in order
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
            self.num_blocks,
            self.block_size,
            self.num_tokens_capacity,
            bytes_per_token,
            self.num_tokens_capacity * bytes_per_token / 2**30,
            self.kv_cache_spec.dtype,
            self.device,
        )
        if len(self.kv_layout.windows) > 1 or self.kv_layout.windows[0] is not None:
            logger.info(
                "KV cache groups of %d layers, windows %s (None: the whole context); a block is one group's %d layers",
                self.kv_layout.num_slots,
                list(self.kv_layout.windows),
                self.kv_layout.num_slots,
            )

    def step_totals(self) -> dict:
        """Steps, tokens and seconds by intra-op thread count since start (engine/threads.py); empty
        where no tuner runs (not CPU)."""
        return self.step_tuner.totals() if self.step_tuner is not None else {}

    @property
    def num_tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def prepare_lora(self, name: str, path: str) -> PreparedLoRA:
        """Read an adapter and check it against the model (ValueError naming what is wrong); changes
        nothing, so it may run in another thread while steps run."""
        self.lora.check_room(name)
        return prepare_lora_adapter(self.model, read_peft_adapter(name, path, self.max_lora_rank), self.lora_dtype)

    def install_lora(self, prepared: PreparedLoRA) -> None:
        """Between two steps (the engine thread): the adapter takes a free slot (tensor parallel: on
        every rank, the workers first, or on none: engine/parallel.py)."""
        slot = self.lora.add(prepared.name)
        if self.ranks is not None:
            try:
                self.ranks.load_lora(prepared.name, prepared.path, slot, self.max_lora_rank)
            except ValueError:
                self.lora.remove(prepared.name)
                raise
        prepared.install(slot)

    def remove_lora(self, name: str) -> None:
        """Between two steps, once no request uses the adapter: its slot is free again."""
        slot = self.lora.remove(name)
        remove_lora_adapter(self.model, slot)
        if self.ranks is not None:
            self.ranks.remove_lora(name, slot)

    def make_generator(self, seed: int | None) -> torch.Generator | None:
        return make_generator(seed, self.device)

    def make_token_history(self, params: SamplingParams) -> TokenHistory | None:
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
        rows: list[int] = []
        samplers: list[ScheduledRequest] = []
        offset = 0
        prompt_rows: list[tuple[ScheduledRequest, int]] = []  # (request, its first row in the logits)
        for s in scheduled:
            if s.prompt_logprob_rows:
                prompt_rows.append((s, len(rows)))
                rows += (offset + j for j in s.prompt_logprob_rows)
            offset += len(s.token_ids)
            if s.samples:  # its last row, and a decode's draft rows: 1 + len(drafts) rows at the end
                rows += range(offset - 1 - len(s.draft_token_ids), offset)
                samplers.append(s)
        inputs = StepInputs(
            token_ids=[t for s in scheduled for t in s.token_ids],
            positions=[p for s in scheduled for p in range(s.start_position, s.start_position + len(s.token_ids))],
            query_lens=[len(s.token_ids) for s in scheduled],
            seq_lens=[s.start_position + len(s.token_ids) for s in scheduled],
            block_tables=[[s.block_tables[g] for s in scheduled] for g in range(len(self.kv_layout.windows))],
            logit_rows=rows,
            onednn=kernels.onednn,
        )
        if self.lora_slots:
            slots = [self.lora_slots[s.params.lora_name] if s.params.lora_name else 0 for s in scheduled]
            inputs.lora_slots = slots if any(slots) else None
        if self.ranks is None:
            logits = self.forward_logits(inputs, kernels)
        else:  # tensor parallel: every rank runs this step; a failure leaves them out of step
            self.ranks.send(inputs)
            try:
                logits = self.forward_logits(inputs, kernels)
            except Exception as e:
                raise EngineDeadError(f"tensor-parallel step failed: {type(e).__name__}: {e}") from e
        if logits is None:
            return RunnerOutput()
        if not prompt_rows:
            return self._sample(logits, samplers)
        return self._with_prompt_logprobs(logits, samplers, prompt_rows)

    def _with_prompt_logprobs(
        self, logits: torch.Tensor, samplers: list[ScheduledRequest], prompt_rows: list[tuple[ScheduledRequest, int]]
    ) -> RunnerOutput:
        """Prompt logprobs from their rows, then sampling on the rest. The logits hold each
        request's prompt rows just before its sampling rows:

            logits rows   [A p p p | A s | B s | C p p]      p: prompt logprobs, s: samples
        """
        is_prompt_row = torch.zeros(logits.shape[0], dtype=torch.bool)
        found = {}
        for s, first in prompt_rows:
            num = len(s.prompt_logprob_rows)
            is_prompt_row[first : first + num] = True
            start = s.start_position + s.prompt_logprob_rows[0] + 1  # the first prompt token given
            targets = s.prompt_token_ids[start : start + num]
            found[s.request_id] = (
                start,
                prompt_logprobs(logits[first : first + num], targets, s.params.prompt_logprobs or 0),
            )
        result = RunnerOutput()
        if samplers:
            keep = (~is_prompt_row).nonzero().squeeze(1).to(logits.device)
            result = self._sample(logits[keep], samplers)
        result.prompt_logprobs = found
        return result

    def forward_logits(self, inputs: StepInputs, kernels: StepKernels | None = None) -> torch.Tensor | None:
        """The step's forward pass and the float32 logits of its `logit_rows` (None: no rows),
        on every rank alike (tensor parallel: rank 0 gets the whole vocabulary)."""
        if kernels is None or kernels.onednn != inputs.onednn:
            kernels = StepKernels(onednn=inputs.onednn)
        if inputs.lora_slots is not None:
            kernels = replace(kernels, lora=LoRABatch.build(inputs.query_lens, inputs.lora_slots, self.device))
        # One host tensor for both inputs: a step of decodes is small, so per-call overhead counts.
        ids = torch.tensor([inputs.token_ids, inputs.positions], dtype=torch.int64, device=self.device)
        metas = [
            AttentionMetadata.build(inputs.query_lens, inputs.seq_lens, tables, self.block_size, self.device, kernels)
            for tables in inputs.block_tables
        ]
        meta = metas[0]
        if len(metas) > 1:
            meta.by_layer = [metas[g] for g in self.kv_layout.layer_groups]
        hidden = self.model(ids[0], ids[1], self.kv_caches, meta)  # (num_tokens, hidden_size)
        rows = inputs.logit_rows
        if not rows:
            return None
        if len(rows) < hidden.shape[0]:  # prefill chunks: only their last rows (and prompt-logprob rows)
            hidden = hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)]  # (num_rows, hidden_size)
        return self.model.compute_logits(hidden, kernels)  # (num_rows, vocab) float32

    def _sample(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> RunnerOutput:
        # The batch attempt may fail after seeded generators drew: the retry starts them
        # where they were, so a seeded request's tokens do not depend on a neighbour failing.
        generators = [s.generator for s in requests if s.generator is not None]
        states = [g.get_state() for g in generators]
        try:
            return self._sample_rows(logits, requests)
        except Exception:
            logger.exception("sampling failed for a batch of %d; retrying request by request", len(requests))
        for generator, state in zip(generators, states):
            generator.set_state(state)
        # One bad request must not cost the others their token: sample each request alone. A
        # failure is that request's error, never the step's (which would end the whole batch).
        result, start = RunnerOutput(), 0
        for request in requests:
            num_rows = 1 + len(request.draft_token_ids)
            try:
                one = self._sample_rows(logits[start : start + num_rows], [request])
            except Exception as e:  # noqa: BLE001 - reported as this request's error
                logger.exception("sampling failed for request %s", request.request_id)
                result.errors[request.request_id] = f"sampling failed: {type(e).__name__}: {e}"
            else:
                result.sampled.update(one.sampled)
                result.logprobs.update(one.logprobs)
            start += num_rows
        return result

    def _sample_rows(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> RunnerOutput:
        return sample_requests(logits, requests, self.model_config.eos_token_ids)
