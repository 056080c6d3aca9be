"""Numbers from a run: client-side summaries of RequestRecords (pure functions)
and the server's own view from its Prometheus /metrics, diffed across the run.

Latencies are reported in milliseconds; records keep seconds.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.client import Outcome, RequestRecord

PERCENTILES = (50, 90, 99)

# Server metric names, ours first, then vLLM's (newer name before older).
SERVER_TTFT = ("pagedserve:time_to_first_token_seconds", "vllm:time_to_first_token_seconds")
SERVER_ITL = (
    "pagedserve:inter_token_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
)
SERVER_GAUGES = {
    "kv_cache": ("pagedserve:kv_blocks_used", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "num_requests_running": ("pagedserve:num_requests_running", "vllm:num_requests_running"),
    "num_requests_waiting": ("pagedserve:num_requests_waiting", "vllm:num_requests_waiting"),
}


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(seconds: list[float]) -> dict:
    """mean and percentiles in ms; None values when there is nothing to measure."""
    stats: dict = {"count": len(seconds), "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    if seconds:
        stats["mean"] = 1000.0 * sum(seconds) / len(seconds)
        for q in PERCENTILES:
            stats[f"p{q}"] = 1000.0 * percentile(seconds, q)
    return stats


def goodput(
    records: list[RequestRecord], duration_s: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None
) -> dict | None:
    """Completed requests per second that met every SLO given (DistServe's goodput).

    A one-token output has no TPOT and so cannot miss a TPOT SLO.
    """
    if slo_ttft_ms is None and slo_tpot_ms is None:
        return None
    good = 0
    for r in records:
        if r.outcome is not Outcome.COMPLETED:
            continue
        if slo_ttft_ms is not None and 1000.0 * r.ttft > slo_ttft_ms:  # type: ignore[operator]
            continue
        if slo_tpot_ms is not None and r.tpot is not None and 1000.0 * r.tpot > slo_tpot_ms:
            continue
        good += 1
    return {
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "num_good": good,
        "request_goodput": good / duration_s if duration_s > 0 else 0.0,
    }


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """Throughput and latency of completed requests; failures and disconnects counted apart.

    Token counts are the server's (usage chunk). Throughputs divide by the
    wall time of the measured run, first send to last completion.
    """
    completed = [r for r in records if r.outcome is Outcome.COMPLETED]
    failed = [r for r in records if r.outcome is Outcome.FAILED]
    disconnected = [r for r in records if r.outcome is Outcome.DISCONNECTED]
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else max(r.prompt_len, 0) for r in completed)
    output_tokens = sum(r.output_tokens for r in completed)
    first_errors: dict[str, str] = {}
    for r in failed:
        first_errors.setdefault(r.error_kind or "unknown", r.error)

    def per_second(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    return {
        "num_requests": len(records),
        "completed": len(completed),
        "failed": len(failed),
        "disconnected": len(disconnected),
        "failures": dict(Counter(r.error_kind or "unknown" for r in failed)),
        "first_error_by_kind": first_errors,
        "stale_connection_retries": sum(r.stale_retries for r in records),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "num_output_len_short": sum(r.output_tokens < r.output_len for r in completed),
        "request_throughput": per_second(len(completed)),
        "input_token_throughput": per_second(input_tokens),
        "output_token_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "ttft_ms": latency_stats([r.ttft for r in completed if r.ttft is not None]),
        "tpot_ms": latency_stats([t for r in completed if (t := r.tpot) is not None]),
        "itl_ms": latency_stats([x for r in completed for x in r.itl]),
        "e2e_ms": latency_stats([r.e2e for r in completed if r.e2e is not None]),
        "goodput": goodput(records, duration_s, slo_ttft_ms, slo_tpot_ms),
    }


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (per model, per engine...).

    Histogram buckets are dropped: only _sum and _count are compared.
    """
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            samples[sample.name] = samples.get(sample.name, 0.0) + float(sample.value)
    return samples


_STEP_TOTALS = {
    "pagedserve:engine_steps": "steps",
    "pagedserve:engine_step_tokens": "tokens",
    "pagedserve:engine_step_seconds": "seconds",
}


def step_totals(base_url: str) -> dict[str, dict[str, float]]:
    """pagedserve's steps, tokens and seconds by intra-op thread count since start ({} from a server
    without them): where the thread tuner ran a run's steps (engine/threads.py)."""
    try:
        response = httpx.get(base_url + "/metrics", timeout=10.0)
        families = list(text_string_to_metric_families(response.text)) if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return {}
    totals: dict[str, dict[str, float]] = {}
    for family in families:
        for sample in family.samples:
            key = _STEP_TOTALS.get(sample.name.removesuffix("_total"))
            if key is not None and "num_threads" in sample.labels:
                totals.setdefault(sample.labels["num_threads"], {})[key] = float(sample.value)
    return totals


def step_totals_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict]:
    """What ran between two `step_totals` scrapes, by thread count (counts that ran nothing left out)."""
    delta = {}
    for threads, totals in after.items():
        ran = {key: value - before.get(threads, {}).get(key, 0.0) for key, value in totals.items()}
        if ran.get("steps", 0) > 0:
            delta[threads] = ran
    return delta


def _first_present(samples: dict[str, float], names: tuple[str, ...], suffix: str = "") -> str | None:
    return next((n for n in names if n + suffix in samples), None)


def histogram_delta_mean(before: dict[str, float], after: dict[str, float], names: tuple[str, ...]) -> dict | None:
    """Mean of the observations made between two scrapes: Δsum / Δcount."""
    name = _first_present(after, names, "_count")
    if name is None:
        return None
    count = after[name + "_count"] - before.get(name + "_count", 0.0)
    total = after[name + "_sum"] - before.get(name + "_sum", 0.0)
    return {"metric": name, "count": int(count), "mean_ms": 1000.0 * total / count if count > 0 else None}


def gauges(samples: dict[str, float]) -> dict[str, tuple[str, float]]:
    """Which of the known gauges the server exposes: key -> (metric, value)."""
    found = {}
    for key, names in SERVER_GAUGES.items():
        name = _first_present(samples, names)
        if name is not None:
            found[key] = (name, samples[name])
    return found


def returned_to_idle(before: dict[str, float], after: dict[str, float]) -> bool:
    """Every gauge back at (or below) its pre-run value."""
    idle = gauges(before)
    return all(value <= idle[key][1] + 1e-9 for key, (_, value) in gauges(after).items() if key in idle)


def server_report(before: dict[str, float], after: dict[str, float], waited_s: float) -> dict:
    """The server's view: latency means over the run, and whether its gauges
    (KV cache, running requests) came back to their idle values afterwards.

    `after` is the scrape that wait_for_idle settled on, so observations the
    server records late (for aborted streams) are included too.
    """
    idle = gauges(before)
    return {
        "ttft": histogram_delta_mean(before, after, SERVER_TTFT),
        "itl": histogram_delta_mean(before, after, SERVER_ITL),
        "gauges": {
            key: {"metric": name, "before": idle[key][1] if key in idle else None, "after": value}
            for key, (name, value) in gauges(after).items()
        },
        "returned_to_idle": returned_to_idle(before, after),
        "idle_wait_s": waited_s,
    }


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The server's /metrics as samples, or None if it has none."""
    try:
        response = await client.get(base_url + "/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse_prometheus(response.text)
    except ValueError:
        return None


async def wait_for_idle(
    client: httpx.AsyncClient, base_url: str, before: dict[str, float], timeout_s: float, interval_s: float = 0.2
) -> tuple[dict[str, float], float]:
    """Poll /metrics until the gauges return to their pre-run values.

    Aborted streams are freed asynchronously by most servers, so a single
    scrape right after the run would report leaks that are not there.
    Returns the last scrape and how long it took.
    """
    start = time.perf_counter()
    while True:
        latest = await scrape(client, base_url) or {}
        elapsed = time.perf_counter() - start
        if returned_to_idle(before, latest) or elapsed >= timeout_s:
            return latest, elapsed
        await asyncio.sleep(interval_s)
