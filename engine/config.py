"""Engine configuration: built once, frozen, validated with clear errors; and the limits
the engine publishes once its KV pool is sized.

The KV pool size is derived here (pure arithmetic, no torch) from the memory
budget and the model's bytes per token, so an MLA model, which stores one small
latent per token, gets many more blocks from the same budget than a GQA model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.speculative import SpeculativeConfig

DEFAULT_KV_CACHE_MEMORY_GIB = 1.0
DEFAULT_KV_CACHE_DISK_BYTES = 20 * 2**30
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


def max_blocks_per_request(windows: tuple[int | None, ...], block_size: int, num_tokens: int, max_chunk: int) -> int:
    """Blocks, over all groups, that one request of num_tokens tokens holds at most when it
    computes at most max_chunk tokens a step: a sliding group, the window before a chunk and the
    chunk (one block more where they straddle a boundary)."""
    full = -(-num_tokens // block_size)
    return sum(full if w is None else min(full, -(-(w - 1 + max_chunk) // block_size) + 1) for w in windows)


def max_tokens_per_request(
    windows: tuple[int | None, ...], block_size: int, num_blocks: int, max_chunk: int, limit: int
) -> int:
    """The longest request, up to `limit` tokens, whose blocks fit on their own in a pool of
    num_blocks (one of them the null block when a group slides)."""
    usable = num_blocks - any(w is not None for w in windows)
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if max_blocks_per_request(windows, block_size, mid, max_chunk) <= usable:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # pool size in blocks; overrides kv_cache_memory_gib
    kv_cache_memory_gib: float | None = None  # pool size as a memory budget
    max_num_seqs: int = 64  # requests in one step at most
    max_num_batched_tokens: int = 2048  # tokens in one step at most (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    # Requests admitted at once beyond max_num_seqs (running + queued); more are refused
    # with QueueFullError. None: no limit.
    max_waiting: int | None = None
    audit_interval_steps: int = 100  # reconcile the block pool every N steps; 0 disables
    # CPU intra-op threads of the thread that runs the model. None: torch's count or one
    # fewer, whichever runs steps faster now (engine/threads.py).
    num_threads: int | None = None
    # The KV cache's dtype. auto: the model's, except float16 under float32 activations with
    # quantized weights (what llama.cpp keeps: half the memory of float32). int8: each token's key
    # and value rows quantized with a float32 scale a row (models/layers/attention.py's
    # quantize_rows): ~3.8x the tokens of float32 in the same memory, ~1.9x those of 16 bits.
    kv_cache_dtype: str = "auto"
    # The prefix cache's disk tier (engine/kv_disk.py): a directory where full blocks leaving
    # memory are kept, at most kv_cache_disk_bytes of files; None: memory only.
    kv_cache_disk: str | None = None
    kv_cache_disk_bytes: int = DEFAULT_KV_CACHE_DISK_BYTES
    # A stream holds at most this many unread outputs; later ones wait in the engine, merged
    # into one, and a stream that stays full this many seconds (its reader stopped) is aborted.
    max_pending_outputs: int = 64
    stalled_stream_timeout: float = 30.0
    # Speculative decoding (engine/speculative.py); None: off.
    speculative: SpeculativeConfig | None = None
    # LoRA adapters served beside the base model: (name, PEFT directory) pairs, read at start
    # (models/layers/lora.py); a request picks one by SamplingParams.lora_name.
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 16  # adapters of a higher rank are refused
    # Adapters held at once, start-up ones included (a load beyond is refused); None: as many as
    # lora_modules. 0: no LoRA at all.
    max_loras: int | None = None
    # The dtype adapters' A and B are held in; auto: the model's. 16 bits halve the bytes a step
    # reads for them; the products still sum in float32 (csrc/lora_ops.cpp).
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_disk is not None and not self.kv_cache_disk:
            raise ValueError("kv_cache_disk must be a directory, got an empty path")
        if self.kv_cache_disk_bytes < 1:
            raise ValueError(f"kv_cache_disk_bytes must be at least 1, got {self.kv_cache_disk_bytes}")
        if self.kv_cache_disk is not None and not self.enable_prefix_caching:
            raise ValueError("kv_cache_disk needs prefix caching on: it keeps the prefix cache's blocks")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.num_kv_blocks is not None and self.kv_cache_memory_gib is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory_gib, not both")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        # Every running request decodes one token per step; the budget must cover them all
        # or a full batch of decodes could never be scheduled together.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.audit_interval_steps < 0:
            raise ValueError(f"audit_interval_steps must be >= 0, got {self.audit_interval_steps}")
        if self.max_pending_outputs < 1:
            raise ValueError(f"max_pending_outputs must be at least 1, got {self.max_pending_outputs}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        lora_names = [name for name, _ in self.lora_modules]
        if any(not name for name in lora_names) or len(set(lora_names)) != len(lora_names):
            raise ValueError(f"LoRA adapter names must be non-empty and distinct, got {lora_names}")
        if self.max_loras is not None and self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.max_loras is not None and self.max_loras < len(self.lora_modules):
            raise ValueError(
                f"max_loras ({self.max_loras}) must be at least the number of lora_modules ({len(self.lora_modules)})"
            )
        if not self.stalled_stream_timeout > 0:
            raise ValueError(f"stalled_stream_timeout must be > 0, got {self.stalled_stream_timeout}")

    @property
    def resolved_max_loras(self) -> int:
        return len(self.lora_modules) if self.max_loras is None else self.max_loras

    def limits(
        self, max_model_len: int, num_blocks: int, vocab_size: int, num_kv_cache_tokens: int | None = None
    ) -> EngineLimits:
        """The limits of an engine serving max_model_len tokens from a pool of num_blocks blocks
        (num_kv_cache_tokens: the longest request the pool holds, if not num_blocks' tokens)."""
        if num_kv_cache_tokens is None:
            num_kv_cache_tokens = num_blocks * self.block_size
        return EngineLimits(
            max_model_len=max_model_len,
            num_kv_cache_tokens=num_kv_cache_tokens,
            vocab_size=vocab_size,
            max_num_seqs=self.max_num_seqs,
            max_waiting=self.max_waiting,
        )

    def resolve_max_model_len(self, model_max_len: int) -> int:
        """The context length the engine serves: ours if set (never above the model's)."""
        if self.max_model_len is None:
            return model_max_len
        if self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context length {model_max_len}")
        return self.max_model_len

    def resolve_num_blocks(self, bytes_per_token: int, max_model_len: int, blocks_per_seq: int | None = None) -> int:
        """Blocks in the KV pool for a model storing `bytes_per_token` bytes per token in a block.

        With neither size given the pool gets the default budget, capped at what
        max_num_seqs full-length requests could ever use (no point holding more): blocks_per_seq
        each (default: max_model_len's blocks).
        """
        if bytes_per_token < 1:
            raise ValueError(f"bytes_per_token must be at least 1, got {bytes_per_token}")
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        bytes_per_block = self.block_size * bytes_per_token
        gib = self.kv_cache_memory_gib if self.kv_cache_memory_gib is not None else DEFAULT_KV_CACHE_MEMORY_GIB
        num_blocks = int(gib * 2**30) // bytes_per_block
        if self.kv_cache_memory_gib is None:
            if blocks_per_seq is None:
                blocks_per_seq = -(-max_model_len // self.block_size)
            num_blocks = min(num_blocks, self.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            raise ValueError(
                f"a KV cache budget of {gib} GiB holds no block of {bytes_per_block} bytes "
                f"({self.block_size} tokens x {bytes_per_token} bytes per token)"
            )
        return num_blocks


@dataclass(frozen=True)
class EngineLimits:
    """What the engine can take, published once (EngineCore.limits, AsyncEngine.limits).

    Front ends (the server, LLM) refuse what does not fit before they submit it, with
    their own messages; the scheduler refuses it again when it is added (`check`), the
    one place in the engine.
    """

    max_model_len: int  # prompt + completion tokens: the context served
    num_kv_cache_tokens: int  # the whole KV pool: no request can hold more
    vocab_size: int
    max_num_seqs: int  # requests in the running batch
    max_waiting: int | None  # requests admitted beyond the running batch; None: no bound

    @property
    def max_request_tokens(self) -> int:
        """Prompt plus completion tokens of the longest request that can ever be served."""
        return min(self.max_model_len, self.num_kv_cache_tokens)

    @property
    def max_in_flight(self) -> int | None:
        """Requests admitted at once (running + queued); None: no bound."""
        return None if self.max_waiting is None else self.max_num_seqs + self.max_waiting

    def check(self, prompt_token_ids: Sequence[int], max_tokens: int) -> None:
        """ValueError for a request that could never be served."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
        num_prompt_tokens = len(prompt_token_ids)
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total} "
                f"tokens, more than the model's context length of {self.max_model_len}"
            )
        if total > self.num_kv_cache_tokens:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total} "
                f"tokens, more than the whole cache holds ({self.num_kv_cache_tokens} tokens)"
            )
