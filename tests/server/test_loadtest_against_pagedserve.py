"""The load generator against the real server (tiny float32 model, real engine, real socket):
its token counts equal the server's own accounting and its timings are consistent."""

import asyncio

from loadtest import BenchmarkConfig, run_benchmark
from loadtest.metrics import step_totals, step_totals_delta
from tests.server.conftest import MODEL_NAME

NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN = 12, 20, 10


def _counter(live, name: str) -> float:
    return live.metric(name)


def test_loadtest_counts_equal_server_usage_and_timings_are_consistent(live):
    prompt_before = _counter(live, "pagedserve:prompt_tokens_total")
    generated_before = _counter(live, "pagedserve:generation_tokens_total")
    steps_before, computed_before = step_totals(live.url), live.engine.stats().num_computed_tokens
    config = BenchmarkConfig(
        url=live.url,
        model=MODEL_NAME,
        num_requests=NUM_REQUESTS,
        concurrency=4,
        input_len=INPUT_LEN,
        output_len=OUTPUT_LEN,
        ignore_eos=True,
        idle_timeout=10.0,
    )
    result = asyncio.run(run_benchmark(config))

    summary = result["summary"]
    assert (summary["completed"], summary["failed"]) == (NUM_REQUESTS, 0), result.get("failures")
    assert result["workload"]["tokenizer"] == "server"  # exact lengths through /tokenize
    # The client's counts (from the usage chunks) equal what the server counted in /metrics.
    assert summary["total_output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    assert summary["total_output_tokens"] == _counter(live, "pagedserve:generation_tokens_total") - generated_before
    assert summary["total_input_tokens"] == _counter(live, "pagedserve:prompt_tokens_total") - prompt_before
    for record in result["requests"]:
        assert record["prompt_tokens"] == INPUT_LEN
        assert record["output_tokens"] == OUTPUT_LEN
        assert 0 < record["ttft_ms"] <= record["e2e_ms"]
        # One gap between consecutive text-bearing chunks; a token whose text is held back
        # (an incomplete UTF-8 character) arrives with the next one, so there can be fewer.
        assert len(record["itl_ms"]) <= OUTPUT_LEN - 1
    # The server's own histograms: one TTFT per request, one inter-token gap per token after the first.
    assert result["server"]["ttft"]["count"] == NUM_REQUESTS
    assert result["server"]["itl"]["count"] == NUM_REQUESTS * (OUTPUT_LEN - 1)
    assert result["server"]["returned_to_idle"]
    # loadtest.compare's per-run steps by thread count: every token the engine ran, in steps of >= 1 thread
    ran = step_totals_delta(steps_before, step_totals(live.url))
    assert ran and all(int(threads) >= 1 and totals["seconds"] > 0 for threads, totals in ran.items())
    assert sum(t["tokens"] for t in ran.values()) == live.engine.stats().num_computed_tokens - computed_before
    assert step_totals("http://127.0.0.1:9") == {}  # nothing listening: no figures, no error
