"""A request's parameters, its life cycle, and what the engine streams back for it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.structured import StructuredOutput


class QueueFullError(RuntimeError):
    """The waiting queue is at max_waiting: retry later (a 429, not a 400)."""


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
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top-k alternatives
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # the output must match this grammar

    def __post_init__(self):
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
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives, best first


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
