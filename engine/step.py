"""One engine step's plain data: what the scheduler hands the runner, and what comes back.

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> RunnerOutput -> Scheduler.update()
    ModelRunner -> StepInputs -> every tensor-parallel rank's forward (engine/parallel.py)

No torch and nothing of the engine but the request's own types: the scheduler, the
block manager and the runner import this module, never each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request import SamplingParams, TokenLogprob

if TYPE_CHECKING:  # for the types only: they import torch
    import torch

    from engine.sampling.metadata import TokenHistory
    from engine.structured import GrammarMatcher


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step (a decode's drafts last)
    start_position: int  # position of token_ids[0] (= num_computed_tokens before the step)
    block_tables: list[list[int]]  # one per KV cache group (engine/block_manager.py)
    samples: bool  # the chunk reaches the end of the request: sample its next token
    # What the sampler needs for this request (plain Python; the runner makes tensors).
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    token_history: TokenHistory | None = None
    grammar: GrammarMatcher | None = None  # when the request's output is constrained
    # A decode's drafts (engine/speculative.py): the last len(draft_token_ids) of token_ids, not
    # tokens of the request until the runner accepts them; each adds a row that samples.
    draft_token_ids: list[int] = field(default_factory=list)
    # Rows of this chunk (0-based within token_ids) whose logits give prompt logprobs: row j
    # gives the logprob of the prompt token at start_position + j + 1. Empty unless asked.
    prompt_logprob_rows: range = range(0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[str]  # request ids sent back to the waiting queue this step
    num_batched_tokens: int


@dataclass
class RunnerOutput:
    # request id -> its new tokens: one, or with drafts the accepted ones and one of its own
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)  # one per token sampled
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why its sampling failed
    # request id -> (prompt position of the first, the prompt logprobs of its prompt_logprob_rows)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


@dataclass
class StepInputs:
    """One step's model inputs, as the runner built them from a SchedulerOutput: what every
    tensor-parallel rank's forward pass needs (sent to the other ranks as it is)."""

    token_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[list[int]]]  # [KV cache group][sequence]
    logit_rows: list[int]  # rows of the step whose logits are computed (empty: none)
    onednn: bool = True  # the step's StepKernels
    lora_slots: list[int] | None = None  # per sequence its LoRA adapter's slot (0: none); None: no adapter


class EngineDeadError(RuntimeError):
    """The engine cannot run steps any more (a tensor-parallel rank is gone): it must stop."""
