"""Prometheus metrics, one registry per app (several apps in one process never collide).

Two kinds of numbers:
- what the server sees per request (latencies, token counts, finish reasons),
  recorded as outputs stream through `RequestTimer`;
- what only the engine knows (running/waiting requests, KV blocks, prefix-cache
  hits, preemptions), read from `engine.stats()` at scrape time by a collector,
  so a scrape always shows the engine's state now, never a stale copy.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.request import RequestOutput
from engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_success = Counter(
            "pagedserve:request_success",
            "Finished engine requests (one per choice) by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.requests_rejected = Counter(
            "pagedserve:requests_rejected",
            "HTTP requests refused before reaching the engine, by reason.",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("pagedserve:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("pagedserve:generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(
            "pagedserve:time_to_first_token_seconds",
            "Arrival at the server to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagedserve:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedserve:e2e_request_latency_seconds",
            "Arrival at the server to the request's last output.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pagedserve:request_queue_time_seconds",
            "Time a request waited in the engine's queue before first being scheduled.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def watch_engine(
        self, stats: Callable[[], EngineStats | None], model_name: str = "", prefix_caching: bool = True
    ) -> None:
        """Expose the engine's own gauges and counters, read at every scrape (and the few that
        routers and autoscalers read under vLLM's names, labelled with `model_name` as vLLM does)."""
        self.registry.register(_EngineCollector(stats, model_name, prefix_caching))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, arrival: float | None = None) -> RequestTimer:
        """`arrival`: time.monotonic() when the HTTP request arrived (default: now)."""
        return RequestTimer(self, arrival)


class RequestTimer:
    """Follows one engine request's outputs and records its latencies once."""

    def __init__(self, metrics: ServerMetrics, arrival: float | None = None):
        self.metrics = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        self.last_token_time: float | None = None

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        num_new = len(output.token_ids)
        if num_new:
            m.generation_tokens.inc(num_new)
            if self.last_token_time is None:
                m.ttft.observe(now - self.arrival)
            else:
                # Tokens that arrive in one increment share the gap since the previous one.
                gap = (now - self.last_token_time) / num_new
                for _ in range(num_new):
                    m.itl.observe(gap)
            self.last_token_time = now
        if output.finished:
            self.on_finished(output.finish_reason or "error", output.num_prompt_tokens, output.queue_time)

    def on_finished(self, finish_reason: str, num_prompt_tokens: int = 0, queue_time: float = 0.0) -> None:
        m = self.metrics
        m.request_success.labels(finish_reason=finish_reason).inc()
        m.prompt_tokens.inc(num_prompt_tokens)
        m.e2e.observe(time.monotonic() - self.arrival)
        if queue_time > 0:
            m.queue_time.observe(queue_time)


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str, prefix_caching: bool):
        self._stats = stats
        self._model_name = model_name
        self._prefix_caching = prefix_caching

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        yield from self._vllm_named(s)
        yield GaugeMetricFamily(
            "pagedserve:num_requests_running", "Requests in the running batch.", value=s.num_running
        )
        yield GaugeMetricFamily(
            "pagedserve:num_requests_waiting", "Requests queued for the engine.", value=s.num_waiting
        )
        yield GaugeMetricFamily(
            "pagedserve:kv_blocks_used", "KV-cache blocks held by requests.", value=s.num_kv_blocks_used
        )
        yield GaugeMetricFamily(
            "pagedserve:kv_blocks_total", "KV-cache blocks in the pool.", value=s.num_kv_blocks_total
        )
        queries = s.prefix_cache_queries
        yield GaugeMetricFamily(
            "pagedserve:prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up, since start.",
            value=s.prefix_cache_hits / queries if queries else 0.0,
        )
        hits = CounterMetricFamily(
            "pagedserve:prefix_cache_hits",
            "Prompt tokens served from the prefix cache, by where their blocks were found, since start.",
            labels=["tier"],
        )
        hits.add_metric(["memory"], s.prefix_cache_hits - s.prefix_cache_disk_hits)
        hits.add_metric(["disk"], s.prefix_cache_disk_hits)
        yield hits
        yield from _kv_disk(s.kv_disk)
        yield CounterMetricFamily(
            "pagedserve:num_preemptions", "Requests preempted to free KV blocks.", value=s.num_preemptions
        )
        yield CounterMetricFamily(
            "pagedserve:num_stalled_aborts",
            "Streams aborted because their client stopped reading (KV blocks freed).",
            value=s.num_stalled_aborts,
        )
        yield CounterMetricFamily(
            "pagedserve:num_grammars_compiled",
            "Structured-output grammars compiled (each distinct schema, regex, choice or grammar).",
            value=s.num_grammars_compiled,
        )
        yield CounterMetricFamily(
            "pagedserve:num_structured_output_requests",
            "Requests whose output was constrained by a grammar.",
            value=s.num_structured_requests,
        )
        yield GaugeMetricFamily(
            "pagedserve:model_weight_bytes",
            "Bytes of model weights resident (quantized weights as stored).",
            value=s.weight_bytes,
        )
        yield GaugeMetricFamily("pagedserve:kv_cache_bytes", "Bytes of the KV-cache pool.", value=s.kv_cache_bytes)
        # CPU: which intra-op thread count the tuner ran steps with, and what they cost (engine/threads.py)
        families = [
            CounterMetricFamily(name, doc, labels=["num_threads"])
            for name, doc in (
                ("pagedserve:engine_steps", "Model steps run, by intra-op thread count (CPU)."),
                (
                    "pagedserve:engine_step_tokens",
                    "Tokens run through the model in those steps, by thread count (CPU).",
                ),
                ("pagedserve:engine_step_seconds", "Seconds those steps took, by thread count (CPU)."),
            )
        ]
        for threads, totals in sorted(s.step_totals.items()):
            for family, value in zip(families, totals):
                family.add_metric([str(threads)], value)
        yield from families

    def _vllm_named(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's names for what the Gateway API Inference Extension / llm-d and KEDA scale and route
        on: queue and batch sizes, KV-cache use as a 0-1 fraction, the cache's configuration."""
        labels, values = ["model_name"], [self._model_name]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch (vLLM's name).", s.num_running),
            ("vllm:num_requests_waiting", "Requests queued for the engine (vLLM's name).", s.num_waiting),
            (
                "vllm:kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use, 0-1 (vLLM's name).",
                s.num_kv_blocks_used / s.num_kv_blocks_total if s.num_kv_blocks_total else 0.0,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        spec = getattr(s, "speculative", None)
        if spec is not None:  # vLLM's speculative decoding counters
            for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Steps in which a request carried drafts.", spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
            ):
                counter = CounterMetricFamily(name, doc, labels=labels)
                counter.add_metric(values, value)
                yield counter
            per_position = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by their position in the draft.",
                labels=[*labels, "position"],
            )
            for position, value in enumerate(spec.accepted_per_position):
                per_position.add_metric([*values, str(position)], value)
            yield per_position
            cut = CounterMetricFamily(
                "pagedserve:spec_decode_num_cut_draft_tokens",
                "Draft tokens cut before verification: by the grammar, or for the token "
                "budget, KV blocks or max_tokens.",
                labels=["reason"],
            )
            cut.add_metric(["grammar"], spec.num_cut_by_grammar)
            cut.add_metric(["budget"], spec.num_cut_by_budget)
            yield cut
        if s.max_loras:  # vLLM's: one sample, its labels the adapters in use now, its value the time
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "LoRA adapters of the running and waiting requests (vLLM's name); value: the time of the snapshot.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            lora.add_metric(
                [str(s.max_loras), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)], time.time()
            )
            yield lora
            requests = CounterMetricFamily(
                "pagedserve:lora_requests",
                "Engine requests (one per choice) that ran with a LoRA adapter, by adapter, since start.",
                labels=["lora_name"],
            )
            for name, value in sorted(s.num_lora_requests.items()):
                requests.add_metric([name], value)
            yield requests
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's configuration (vLLM's name); value 1.",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric([str(s.kv_block_size), str(s.num_kv_blocks_total), str(self._prefix_caching)], 1.0)
        yield info


def _kv_disk(d: object | None) -> Iterator[Metric]:
    """The prefix cache's disk tier (engine/kv_disk.py's DiskTierStats), when there is one."""
    from engine.kv_disk import DiskTierStats

    if not isinstance(d, DiskTierStats):
        return
    yield GaugeMetricFamily(
        "pagedserve:kv_disk_enabled", "1 while the disk tier serves, 0 once a write failed.", value=d.enabled
    )
    yield GaugeMetricFamily("pagedserve:kv_disk_bytes", "Bytes of block files in the disk tier now.", value=d.num_bytes)
    yield GaugeMetricFamily("pagedserve:kv_disk_max_bytes", "The disk tier's bound in bytes.", value=d.max_bytes)
    for name, doc, value in (
        ("pagedserve:kv_disk_read_bytes", "Bytes read back from the disk tier.", d.bytes_read),
        ("pagedserve:kv_disk_written_bytes", "Bytes written to the disk tier.", d.bytes_written),
        ("pagedserve:kv_disk_read_seconds", "Seconds the engine thread spent reading the disk tier.", d.read_seconds),
        ("pagedserve:kv_disk_write_seconds", "Seconds the writer thread spent writing the disk tier.", d.write_seconds),
        (
            "pagedserve:kv_disk_files_rejected",
            "Disk tier files found torn, truncated, of another model or format version: removed, not served.",
            d.num_files_rejected,
        ),
        (
            "pagedserve:kv_disk_writes_dropped",
            "Blocks not written to the disk tier: its queue was full.",
            d.num_writes_dropped,
        ),
    ):
        yield CounterMetricFamily(name, doc, value=value)
