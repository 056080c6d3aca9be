"""Client-side summaries and server /metrics diffs, against hand-computed numbers."""

import random

import numpy as np
import pytest

from loadtest.client import Outcome, RequestRecord
from loadtest.metrics import (
    goodput,
    histogram_delta_mean,
    latency_stats,
    parse_prometheus,
    percentile,
    returned_to_idle,
    server_report,
    summarize,
)


def record(index, ttft, chunk_times, e2e, output_tokens, prompt_tokens=10, outcome=Outcome.COMPLETED, kind=None):
    return RequestRecord(
        index=index,
        outcome=outcome,
        start=0.0,
        prompt_len=10,
        output_len=output_tokens,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        ttft=ttft,
        e2e=e2e,
        chunk_times=chunk_times,
        error_kind=kind,
        error="boom" if kind else "",
    )


# Three completed requests (seconds, binary fractions so float sums are exact):
#   r0: tokens at 0.125, 0.25, 0.5   e2e 0.625, 3 tokens -> TPOT (0.625 - 0.125) / 2 = 0.25
#   r1: tokens at 0.375, 0.5         e2e 0.625, 2 tokens -> TPOT 0.25
#   r2: one token at 0.25            e2e 0.25,  1 token  -> no TPOT
RECORDS = [
    record(0, 0.125, [0.125, 0.25, 0.5], 0.625, 3),
    record(1, 0.375, [0.375, 0.5], 0.625, 2, prompt_tokens=20),
    record(2, 0.25, [0.25], 0.25, 1),
    record(3, None, [], 0.0625, 0, outcome=Outcome.FAILED, kind="http_503"),
    record(4, 0.125, [0.125, 0.25], 0.25, 2, outcome=Outcome.DISCONNECTED),
]


def test_percentile_matches_numpy_linear_interpolation():
    rng = random.Random(0)
    for n in (1, 2, 5, 101):
        values = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_stats_in_milliseconds():
    stats = latency_stats([0.1, 0.2, 0.3, 0.4])
    assert stats["count"] == 4
    assert stats["mean"] == pytest.approx(250.0)
    assert stats["p50"] == pytest.approx(250.0)
    assert stats["p90"] == pytest.approx(370.0)  # rank 2.7: 300 + 0.7 * 100
    assert latency_stats([])["p99"] is None


def test_tpot_excludes_the_first_token():
    assert RECORDS[0].tpot == 0.25
    assert RECORDS[1].tpot == 0.25
    assert RECORDS[2].tpot is None
    assert RECORDS[0].itl == [0.125, 0.25]


def test_summary_counts_only_completed_requests_in_throughput_and_latency():
    s = summarize(RECORDS, duration_s=2.0)
    assert (s["completed"], s["failed"], s["disconnected"]) == (3, 1, 1)
    assert s["failures"] == {"http_503": 1}
    assert s["first_error_by_kind"] == {"http_503": "boom"}
    assert s["total_input_tokens"] == 40
    assert s["total_output_tokens"] == 6
    assert s["request_throughput"] == 1.5
    assert s["output_token_throughput"] == 3.0
    assert s["total_token_throughput"] == 23.0
    assert s["ttft_ms"]["mean"] == pytest.approx(250.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert s["tpot_ms"]["count"] == 2 and s["tpot_ms"]["mean"] == pytest.approx(250.0)
    # ITL pools the gaps of all requests: r0 gives 0.125 and 0.25, r1 gives 0.125.
    assert s["itl_ms"]["count"] == 3 and s["itl_ms"]["mean"] == pytest.approx(500.0 / 3)
    assert s["itl_ms"]["p50"] == pytest.approx(125.0)
    assert s["e2e_ms"]["mean"] == pytest.approx(500.0)
    assert s["goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    # TTFT <= 150 ms: r0 only. TPOT <= 250 ms: all three (one token has no TPOT to miss).
    assert goodput(RECORDS, 2.0, 150.0, None)["num_good"] == 1
    assert goodput(RECORDS, 2.0, None, 250.0)["num_good"] == 3
    assert goodput(RECORDS, 2.0, None, 249.0)["num_good"] == 1
    both = goodput(RECORDS, 2.0, 300.0, 249.0)  # r0 misses TPOT, r1 misses TTFT
    assert both["num_good"] == 1 and both["request_goodput"] == 0.5
    assert goodput(RECORDS, 2.0, None, None) is None


METRICS_BEFORE = """
# HELP pagedserve:time_to_first_token_seconds TTFT
# TYPE pagedserve:time_to_first_token_seconds histogram
pagedserve:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
pagedserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2.0
pagedserve:time_to_first_token_seconds_sum{model_name="m"} 0.5
pagedserve:time_to_first_token_seconds_count{model_name="m"} 2.0
# TYPE pagedserve:kv_blocks_used gauge
pagedserve:kv_blocks_used 3.0
# TYPE pagedserve:num_requests_running gauge
pagedserve:num_requests_running{engine="0"} 0.0
pagedserve:num_requests_running{engine="1"} 0.0
"""


def test_prometheus_text_with_colon_names_is_summed_over_labels():
    samples = parse_prometheus(METRICS_BEFORE)
    assert samples["pagedserve:time_to_first_token_seconds_count"] == 2.0
    assert samples["pagedserve:num_requests_running"] == 0.0
    assert not any(name.endswith("_bucket") for name in samples)


def test_histogram_delta_mean_covers_only_the_run():
    before = {"pagedserve:time_to_first_token_seconds_sum": 0.5, "pagedserve:time_to_first_token_seconds_count": 2}
    after = {"pagedserve:time_to_first_token_seconds_sum": 1.5, "pagedserve:time_to_first_token_seconds_count": 6}
    delta = histogram_delta_mean(before, after, ("pagedserve:time_to_first_token_seconds",))
    assert delta == {"metric": "pagedserve:time_to_first_token_seconds", "count": 4, "mean_ms": pytest.approx(250.0)}


def test_vllm_metric_names_are_accepted():
    before = {
        "vllm:time_per_output_token_seconds_sum": 0.0,
        "vllm:time_per_output_token_seconds_count": 0.0,
        "vllm:gpu_cache_usage_perc": 0.0,
        "vllm:num_requests_running": 0.0,
    }
    after = dict(
        before, **{"vllm:time_per_output_token_seconds_sum": 0.3, "vllm:time_per_output_token_seconds_count": 10.0}
    )
    report = server_report(before, after, waited_s=0.0)
    assert report["ttft"] is None
    assert report["itl"]["metric"] == "vllm:time_per_output_token_seconds"
    assert report["itl"]["mean_ms"] == pytest.approx(30.0)
    assert report["gauges"]["kv_cache"]["metric"] == "vllm:gpu_cache_usage_perc"
    assert report["returned_to_idle"]


def test_gauges_still_above_idle_are_reported_as_not_returned():
    before = parse_prometheus(METRICS_BEFORE)
    leaked = dict(before, **{"pagedserve:kv_blocks_used": 7.0})
    assert returned_to_idle(before, before)
    assert not returned_to_idle(before, leaked)
    report = server_report(before, leaked, waited_s=10.0)
    assert report["gauges"]["kv_cache"] == {"metric": "pagedserve:kv_blocks_used", "before": 3.0, "after": 7.0}
    assert not report["returned_to_idle"]
