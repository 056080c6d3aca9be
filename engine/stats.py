"""A snapshot of the engine's state and counters, taken by the engine thread after each step.

Per-request latencies travel with the outputs themselves (RequestOutput.queue_time,
prefill_time, decode_time; time to first token = queue_time + prefill_time, known
from the first output on), so the server builds its histograms from the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0  # held by requests
    num_kv_blocks_cached: int = 0  # holding a reusable prefix (held or evictable)
    kv_block_size: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up, since start
    prefix_cache_hits: int = 0  # prompt tokens served from the cache, since start
    prefix_cache_disk_hits: int = 0  # of those, read back from the disk tier (engine/kv_disk.py)
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of accepted requests
    num_generation_tokens: int = 0  # tokens sampled
    num_computed_tokens: int = 0  # tokens run through the model (prefill, recompute, decode)
    num_steps: int = 0
    num_failed_steps: int = 0  # forward passes that raised (their requests ended with "error")
    num_audit_discrepancies: int = 0  # block-pool audit findings, since start
    num_stalled_aborts: int = 0  # streams aborted because their reader stopped reading (AsyncEngine)
    num_grammars_compiled: int = 0  # structured-output grammars compiled, since start
    num_structured_requests: int = 0  # requests under a grammar (hit rate: 1 - compiled / these)
    num_finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> requests
    # Speculative decoding (engine/speculative.py), since start; None when it is off.
    speculative: object | None = None  # a SpecStats snapshot
    weight_bytes: int = 0  # model parameters resident, quantized weights as stored
    kv_cache_bytes: int = 0  # the KV pool, allocated at start
    # CPU: thread count -> (steps, tokens, seconds) run with it, since start (engine/threads.py)
    step_totals: dict[int, tuple[int, int, float]] = field(default_factory=dict)
    # LoRA (engine/lora.py): adapters held at most (0: LoRA off), those of the running and the
    # waiting requests, and requests per adapter since start
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    num_lora_requests: dict[str, int] = field(default_factory=dict)
    # The prefix cache's disk tier (engine/kv_disk.py's DiskTierStats); None: no disk tier
    kv_disk: object | None = None

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
