"""A request's parameters, its life cycle, its state, and what the engine streams back for it.

Plain data: imports nothing of the engine. The scheduler is the only writer of a
Request's status and blocks; the others read it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.structured import StructuredOutput

if TYPE_CHECKING:
    import torch

    from engine.structured import GrammarMatcher

# Temperatures below this are greedy: dividing logits by them would overflow float32.
GREEDY_TEMPERATURE = 1e-5


class QueueFullError(RuntimeError):
    """max_num_seqs + max_waiting requests are in flight: retry later (a 429, not a 400)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context
    FINISHED_ABORTED = "finished_aborted"  # client went away or abort() was called
    FINISHED_ERROR = "finished_error"  # this request failed; the engine serves on

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASON

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's `finish_reason` for a finished request, None while it runs."""
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping, validated once at construction.

    `n` is handled above the engine core: each of the n samples is its own
    request (`request_id-i`) and they share the prompt's KV blocks through the
    prefix cache.
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy (so does anything below GREEDY_TEMPERATURE)
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top-k alternatives
    # None: none; k >= 0: each prompt token's logprob given the tokens before it, and the top-k there
    # (raw logits: no temperature, penalty or bias applies to the prompt).
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # the output must match this grammar
    # vLLM's `cache_salt`: the prefix cache shares blocks only among requests with the same salt (None:
    # among unsalted ones), so one tenant cannot learn from another's cache hits what it was sent.
    cache_salt: str | None = None
    # The LoRA adapter (EngineConfig.lora_modules) this request runs with; None: the base model.
    # Its prefix-cache blocks are its own, as with a salt.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be non-empty")
        if self.lora_name is not None and not self.lora_name:
            raise ValueError("lora_name must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    generator: torch.Generator | None = None  # the sampler's per-request RNG
    # The sampler's per-request penalty cache, a TokenHistory: Any, as its module imports this one.
    token_history: Any = None
    grammar: GrammarMatcher | None = None  # its structured output's matcher (engine/structured.py)
    # Its speculative decoding's DraftState: Any, as engine/speculative.py imports this module.
    draft_state: Any = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # filled by the block manager
    # What the prefix cache keys its LoRA adapter by (engine/lora.py): the name and which load of
    # it; None: params.lora_name.
    lora_cache_key: str | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)  # prompt + output, what the KV cache holds
        if self.lora_cache_key is None:
            self.lora_cache_key = self.params.lora_name

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def drop_last_outputs(self, num: int) -> None:
        """Take back the last `num` output tokens (what a stop string inside a run cut off)."""
        if num > 0:
            del self.output_token_ids[-num:], self.all_token_ids[-num:]

    def append_output(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives, best first
    rank: int | None = None  # 1 + how many tokens are likelier (prompt logprobs; None where not computed)


@dataclass
class RequestOutput:
    """One increment of a request's stream; the last one has `finished` set.

    `text` and `token_ids` are the *new* pieces since the previous output;
    concatenating every `text` gives exactly the final decoded completion.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    error: str | None = None
    # Where the time went, in seconds (filled on the final output; 0 until known).
    queue_time: float = 0.0  # arrival -> first scheduled
    prefill_time: float = 0.0  # first scheduled -> first token
    decode_time: float = 0.0  # first token -> last token
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With SamplingParams.prompt_logprobs, on the output that brings the first token (or the final
    # one): one entry per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
