"""End to end over real HTTP against the protocol stand-in (conftest.py).

`assert_consistent` holds for any correct server; a live test against the
real pagedserve server is the same one-liner with its url:

    assert_consistent(asyncio.run(run_benchmark(BenchmarkConfig(url=url, model=name, ...)))
"""

import asyncio
import json

import pytest

from loadtest import BenchmarkConfig, run_benchmark
from loadtest.__main__ import main

SMALL = dict(model="standin", num_requests=24, input_len=24, output_len=12, ignore_eos=True, idle_timeout=5.0)


def run(url, **overrides):
    return asyncio.run(run_benchmark(BenchmarkConfig(url=url, **{**SMALL, **overrides})))


def assert_consistent(result: dict) -> None:
    """Invariants of the timings and counts of every completed request."""
    done = [r for r in result["requests"] if r["outcome"] == "completed"]
    for r in done:
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
        assert r["itl_ms"] == [] or min(r["itl_ms"]) >= 0
    s = result["summary"]
    assert s["completed"] + s["failed"] + s["disconnected"] == s["num_requests"]
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in done)
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in done)


def test_token_counts_equal_the_server_usage_and_timings_are_consistent(standin):
    server = standin()
    result = run(server.url, concurrency=4)
    assert_consistent(result)
    s = result["summary"]
    assert (s["completed"], s["failed"], s["disconnected"]) == (24, 0, 0)
    usage = server.state.usage_log
    assert s["total_output_tokens"] == sum(u["completion_tokens"] for u in usage) == 24 * 12
    assert s["total_input_tokens"] == sum(u["prompt_tokens"] for u in usage)
    assert result["workload"]["tokenizer"] == "server"
    for r in result["requests"]:
        assert r["prompt_tokens"] == r["prompt_len"] == 24  # /tokenize counted what the server counts
        assert len(r["itl_ms"]) == r["output_tokens"] - 1  # one token per chunk from the stand-in
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1), abs=1e-2)
    # The server's own histograms saw the same requests and tokens.
    assert result["server"]["ttft"]["count"] == 24
    assert result["server"]["itl"]["count"] == 24 * 11
    assert result["server"]["returned_to_idle"]


def test_disconnect_fraction_is_honoured_and_not_counted_as_failure(standin):
    server = standin(token_delay_s=0.003)
    result = run(server.url, concurrency=8, disconnect_fraction=0.25, output_len=24)
    assert_consistent(result)
    s = result["summary"]
    assert (s["completed"], s["failed"], s["disconnected"]) == (18, 0, 6)
    cut = [r for r in result["requests"] if r["outcome"] == "disconnected"]
    assert all(1 <= r["output_tokens"] < 24 for r in cut)
    assert server.state.num_aborted >= 1  # the server really saw connections close
    assert result["server"]["returned_to_idle"]  # and freed their KV blocks


@pytest.mark.parametrize(
    "fault, kind",
    [
        ("missing_done", "missing_done"),
        ("invalid_json", "invalid_json"),
        ("inconsistent_id", "inconsistent_id"),
        ("http_500", "http_500"),
    ],
)
def test_protocol_faults_are_failures_by_kind(standin, fault, kind):
    server = standin(fault=fault, fault_every=4)
    result = run(server.url, concurrency=3, num_requests=12)
    s = result["summary"]
    assert s["failures"] == {kind: 3}
    assert s["completed"] == 9
    assert_consistent(result)


def test_chat_endpoint_counts_template_tokens_from_usage(standin):
    server = standin()
    result = run(server.url, endpoint="chat", concurrency=4, num_requests=8)
    assert_consistent(result)
    assert result["summary"]["completed"] == 8
    for r in result["requests"]:
        assert r["prompt_tokens"] == 24 + 3  # content (BOS included) + the stand-in's chat framing
        assert len(r["itl_ms"]) == 11  # the role-only first chunk is not a token


def test_token_id_prompts_when_the_server_cannot_tokenize(standin):
    server = standin(tokenize_endpoints=False)
    result = run(server.url, concurrency=4, num_requests=8)
    assert result["workload"]["tokenizer"] == "token-ids"
    assert [r["prompt_tokens"] for r in result["requests"]] == [24] * 8
    with pytest.raises(RuntimeError, match="--tokenizer"):
        run(server.url, endpoint="chat")


def test_open_loop_rate_with_duration_bound_stops_sending(standin):
    server = standin()
    result = run(server.url, request_rate=40.0, duration=0.25, num_requests=40, output_len=4)
    assert 2 <= result["summary"]["num_requests"] < 40
    assert result["summary"]["failed"] == 0


def test_goodput_and_warmup(standin):
    server = standin()
    result = run(server.url, concurrency=4, num_requests=8, warmup=4, slo_ttft_ms=10_000, slo_tpot_ms=10_000)
    assert result["summary"]["goodput"]["num_good"] == 8
    assert len(server.state.usage_log) == 12  # warmup requests were sent ...
    assert result["server"]["ttft"]["count"] == 8  # ... but are not part of the measured window


def test_cli_sweep_writes_tables_and_json(standin, tmp_path, capsys):
    server = standin()
    out = tmp_path / "result.json"
    argv = [
        "--url",
        server.url + "/v1",
        "--model",
        "standin",
        "--concurrency",
        "1,4",
        "--num-requests",
        "6",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--ignore-eos",
        "--json",
        str(out),
        "--quiet",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "concurrency" in printed
    result = json.loads(out.read_text())
    assert result["sweep"] == "concurrency" and result["values"] == [1, 4]
    assert [run["summary"]["completed"] for run in result["runs"]] == [6, 6]
    assert result["runs"][0]["config"]["request_rate"] == "inf"


def test_cli_plot(standin, tmp_path):
    pytest.importorskip("matplotlib")
    server = standin()
    png = tmp_path / "latency.png"
    argv = [
        "--url",
        server.url,
        "--model",
        "standin",
        "--num-requests",
        "6",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--plot",
        str(png),
        "--quiet",
    ]
    assert main(argv) == 0
    assert png.stat().st_size > 0
