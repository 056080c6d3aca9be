"""run_benchmark(config) -> dict: build the workload, warm up, send the
measured requests on schedule, and read the server's /metrics around them.

    result = asyncio.run(run_benchmark(BenchmarkConfig(url=url, model="m", num_requests=50)))
    result["summary"]["output_token_throughput"]
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

import httpx

from loadtest.client import Outcome, RequestRecord, build_payload, send_request
from loadtest.config import BenchmarkConfig
from loadtest.metrics import scrape, server_report, summarize, wait_for_idle
from loadtest.report import ProgressBar
from loadtest.tokenizer import Tokenizer, resolve_tokenizer
from loadtest.workload import RequestSpec, Workload, arrival_times, dataset_workload, synthetic_workload


async def run_benchmark(config: BenchmarkConfig) -> dict:
    """One measured run. The result holds `config`, `workload`, `summary`
    (see metrics.summarize), `server` (None without /metrics) and `requests`
    (one dict per request, for plots and offline analysis)."""
    async with _aux_client(config) as aux:
        tokenizer = await resolve_tokenizer(aux, config.base_url, config.tokenizer)
        workload = await build_workload(config, tokenizer, config.num_requests)
        async with _bench_client(config) as client:
            if config.warmup:
                await _warm_up(client, config, await build_workload(config, tokenizer, config.warmup, "warmup"))
            before = await scrape(aux, config.base_url) if config.server_metrics else None
            plan = disconnect_plan(workload.requests, config.disconnect_fraction, config.seed)
            progress = ProgressBar(len(workload.requests)) if config.progress else None
            start = time.perf_counter()
            records = await _send_all(client, config, workload.requests, plan, progress)
            duration = time.perf_counter() - start
            if progress:
                progress.close()
        server = None
        if before is not None:
            after, waited = await wait_for_idle(aux, config.base_url, before, config.idle_timeout)
            server = server_report(before, after, waited)
    return {
        "config": config.to_dict(),
        "workload": workload.info(),
        "summary": summarize(records, duration, config.slo_ttft_ms, config.slo_tpot_ms),
        "server": server,
        "requests": [record_to_dict(r) for r in records],
    }


async def run_sweep(config: BenchmarkConfig, field: str, values: list) -> dict:
    """One run per value of `field` ("concurrency" or "request_rate").

    Each point gets its own seed, hence its own prompts: reusing the previous
    point's prompts would measure the server's prefix cache, not its load.
    """
    runs = []
    for i, value in enumerate(values):
        runs.append(await run_benchmark(replace(config, **{field: value, "seed": config.seed + i})))
    return {"sweep": field, "values": list(values), "runs": runs}


async def build_workload(
    config: BenchmarkConfig, tokenizer: Tokenizer | None, num_requests: int, salt: str = ""
) -> Workload:
    """The measured requests; with a `salt` (warmup), different prompts of the same shape."""
    if config.dataset is not None:
        seed = config.seed + 1 if salt else config.seed  # warmup starts from other lines
        return await dataset_workload(config.dataset, num_requests, config.output_len, seed, config.endpoint, tokenizer)
    if tokenizer is None and config.endpoint == "chat":
        raise RuntimeError(
            "random chat prompts need a tokenizer: the server has no /tokenize and /detokenize, "
            "so pass --tokenizer NAME_OR_PATH (or use --endpoint completions for token-id prompts)"
        )
    return await synthetic_workload(
        tokenizer,
        num_requests,
        config.input_len,
        config.output_len,
        config.seed,
        config.prefix_len,
        config.num_prefixes,
        salt,
    )


async def _warm_up(client: httpx.AsyncClient, config: BenchmarkConfig, warmup: Workload) -> None:
    """Unmeasured requests at the run's concurrency, all sent at once. Fresh
    random prompts, so the measured run's prefix-cache behaviour is unchanged.
    If every one fails, the measured run would too: stop with the reason."""
    records = await _send_all(
        client, replace(config, request_rate=float("inf"), duration=None), warmup.requests, {}, None
    )
    if all(r.outcome is Outcome.FAILED for r in records):
        first = records[0]
        raise RuntimeError(f"all {len(records)} warmup requests failed; first: {first.error_kind}: {first.error}")


def disconnect_plan(requests: list[RequestSpec], fraction: float, seed: int) -> dict[int, int]:
    """Request index -> content chunks to read before closing the stream.

    Exactly round(fraction * n) requests are chosen (among those that can be cut
    mid-way: two or more output tokens), each after 1..output_len-1 chunks.
    """
    candidates = [r for r in requests if r.output_len >= 2]
    count = min(round(fraction * len(requests)), len(candidates))
    rng = random.Random(f"{seed}:disconnect")
    return {r.index: rng.randint(1, r.output_len - 1) for r in rng.sample(candidates, count)}


async def _send_all(
    client: httpx.AsyncClient,
    config: BenchmarkConfig,
    requests: list[RequestSpec],
    disconnect_after: dict[int, int],
    progress: ProgressBar | None,
) -> list[RequestRecord]:
    """Send on the arrival schedule, at most `concurrency` in flight; stop
    sending (but let in-flight requests finish) once `duration` has passed."""
    times = arrival_times(len(requests), config.request_rate, config.burstiness, config.seed)
    slots = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    deadline = config.duration
    start = time.perf_counter()

    async def one(spec: RequestSpec) -> RequestRecord:
        try:
            payload = build_payload(
                spec, config.model_for(spec.index), config.endpoint, config.ignore_eos, config.extra_body
            )
            record = await send_request(
                client, config.api_url, payload, spec, config.endpoint, disconnect_after.get(spec.index)
            )
        finally:
            if slots:
                slots.release()
        if progress:
            progress.update(record.outcome is Outcome.FAILED)
        return record

    tasks = []
    for spec, at in zip(requests, times, strict=True):
        if deadline is not None and at >= deadline:
            break
        if (delay := start + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        if slots:
            await slots.acquire()  # closed loop: the next request waits for a free slot
        if deadline is not None and time.perf_counter() - start >= deadline:
            if slots:
                slots.release()
            break
        tasks.append(asyncio.create_task(one(spec)))
    return list(await asyncio.gather(*tasks))


def record_to_dict(r: RequestRecord) -> dict:
    def ms(x: float | None) -> float | None:
        return None if x is None else round(1000.0 * x, 3)

    return {
        "index": r.index,
        "outcome": r.outcome.value,
        "error_kind": r.error_kind,
        "error": r.error or None,
        "prompt_len": r.prompt_len,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "ttft_ms": ms(r.ttft),
        "tpot_ms": ms(r.tpot),
        "e2e_ms": ms(r.e2e),
        "itl_ms": [ms(x) for x in r.itl],
    }


def _headers(config: BenchmarkConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def _bench_client(config: BenchmarkConfig) -> httpx.AsyncClient:
    # httpx pools 100 connections by default; a request waiting for one would
    # count pool time as TTFT, so the pool is as large as the load.
    limit = config.concurrency or max(config.num_requests, config.warmup, 1)
    return httpx.AsyncClient(
        headers=_headers(config),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        timeout=httpx.Timeout(config.request_timeout, connect=min(30.0, config.request_timeout)),
    )


def _aux_client(config: BenchmarkConfig) -> httpx.AsyncClient:
    """Tokenizer and /metrics calls, kept off the benchmark's connection pool."""
    return httpx.AsyncClient(headers=_headers(config), timeout=httpx.Timeout(30.0))
