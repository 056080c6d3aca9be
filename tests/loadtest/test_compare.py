"""loadtest.compare's arguments: a wrong --llama-server or --model fails before any server starts;
both servers get the same threads, and ours the CPU unless told otherwise; and a run of ours alone
on a tiny GGUF reports every concurrency."""

from __future__ import annotations

import argparse
import json

import pytest

from loadtest.compare import build_parser, check_executable, main, merge_rounds, report, resolve_model, server_commands


def test_llama_server_must_be_an_executable_file(tmp_path):
    program = tmp_path / "llama-server"
    program.write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match="no executable file"):
        check_executable(str(program))  # not executable yet
    program.chmod(0o755)
    assert check_executable(str(program)) == program
    for wrong in ("", str(tmp_path), str(tmp_path / "missing")):  # "": a failed $(...) in the shell
        with pytest.raises(ValueError, match="no executable file"):
            check_executable(wrong)


def test_missing_llama_server_exits_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--llama-server", "/nonexistent/llama-server"])
    assert exit_info.value.code == 2
    assert "/nonexistent/llama-server" in capsys.readouterr().err


def test_model_is_a_file_or_a_known_shape_and_type(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert resolve_model(str(model)) == model
    for wrong in (str(tmp_path / "missing.gguf"), "smollm2-9b:q4_0", "smollm2-360m:q2_k"):
        with pytest.raises(ValueError, match="no such checkpoint directory or .gguf file.*nor SHAPE:TYPE"):
            resolve_model(wrong)


def test_both_servers_get_the_same_threads_and_ours_the_cpu_by_default():
    args = argparse.Namespace(
        model="m.gguf", llama_server="/bin/llama-server", quantization="auto", device="cpu", ctx=4096, slots=16
    )
    ours, theirs = server_commands(args, 8000, 8).values()
    # --device auto would take a GPU where there is one, against llama-server's CPU build.
    assert ours[ours.index("--device") + 1] == "cpu"
    assert ours[ours.index("--num-threads") + 1] == theirs[theirs.index("-t") + 1] == "8"
    args.device = "cuda:1"
    assert "cuda:1" in server_commands(args, 8000, 8)["pagedserve"]


def test_huge_pages_are_read_for_a_live_process_and_none_for_a_gone_one():
    import os

    from loadtest.compare import huge_pages_mb

    assert huge_pages_mb(os.getpid()) >= 0
    assert huge_pages_mb(2**30) is None  # beyond pid_max: no such process


def test_device_defaults_to_cpu():
    assert build_parser().parse_args([]).device == "cpu"


def test_rounds_merge_into_medians_and_sums():
    def run(tok_s, failed=0):
        return {
            "output_tok_s": tok_s,
            "ttft_p50_ms": 1000 / tok_s,
            "itl_p50_ms": 100 / tok_s,
            "completed": 8,
            "failed": failed,
            "failures": {"timeout": failed} if failed else {},
            "stale_connection_retries": 1,
            "first_error_by_kind": {"timeout": "slow"} if failed else {},
        }

    merged = merge_rounds([run(10.0), run(30.0, failed=2), run(20.0)])
    assert merged["output_tok_s"] == 20.0 and merged["itl_p50_ms"] == 5.0 and merged["ttft_p50_ms"] == 50.0
    assert merged["completed"] == 24 and merged["failed"] == 2 and merged["failures"] == {"timeout": 2}
    assert merged["stale_connection_retries"] == 3 and merged["first_error_by_kind"] == {"timeout": "slow"}
    assert [r["output_tok_s"] for r in merged["rounds"]] == [10.0, 30.0, 20.0]
    assert build_parser().parse_args([]).rounds == 1


def test_rounds_alternate_the_servers_on_fresh_servers_and_prompts(monkeypatch):
    import contextlib
    import types

    import loadtest.compare as compare

    calls = []

    async def fake_run(config):
        calls.append((config.url, config.concurrency, config.seed))
        return {
            "summary": {
                "output_token_throughput": 1.0,
                "ttft_ms": {"p50": 1.0},
                "itl_ms": {"p50": 1.0},
                "completed": 8,
                "failed": 0,
                "failures": {},
                "stale_connection_retries": 0,
                "first_error_by_kind": {},
            }
        }

    starts = []

    @contextlib.contextmanager
    def fake_side_by_side(commands):
        starts.append(len(calls))
        yield {name: f"http://{name}" for name in commands}, {name: types.SimpleNamespace(pid=0) for name in commands}

    monkeypatch.setattr(compare, "run_benchmark", fake_run)
    monkeypatch.setattr(compare, "side_by_side", fake_side_by_side)
    monkeypatch.setattr(compare, "rss_mb", lambda pid: 1.0)
    monkeypatch.setattr(compare, "step_totals", lambda url: {"2": {"steps": len(calls), "tokens": 1.0, "seconds": 1.0}})
    args = build_parser().parse_args(["--model", "m.gguf", "--concurrency", "1", "16", "--rounds", "3"])
    results = compare.measure({"ours": ["x"], "theirs": ["y"]}, args, "tok")
    first = [url for url, _, _ in calls[::2]]  # who goes first, concurrency after concurrency, round after round
    assert first == ["http://ours", "http://theirs", "http://theirs", "http://ours", "http://ours", "http://theirs"]
    for c in (1, 16):
        seeds = [seed for url, conc, seed in calls if conc == c and url == "http://ours"]
        assert len(set(seeds)) == 3  # each round its own prompts: none served from a prefix cache
        assert seeds == [seed for url, conc, seed in calls if conc == c and url == "http://theirs"]  # both the same
    assert [len(r["runs"][1]["rounds"]) for r in results] == [3, 3]
    assert starts == [0, 4, 8]  # fresh servers each round
    assert all(
        r["steps_by_threads"] == {"2": {"steps": 1, "tokens": 0.0, "seconds": 0.0}}
        for result in results
        for r in result["runs"][16]["rounds"]
    )  # each run's own steps


def test_several_thread_counts_get_a_table_each_and_a_scaling_table():
    args = build_parser().parse_args(["--model", "m.gguf", "--threads", "1", "4", "--concurrency", "1", "16"])
    assert args.threads == [1, 4]

    def result(server, threads, speed):
        runs = {c: {"output_tok_s": speed * c, "itl_p50_ms": 100 / speed, "ttft_p50_ms": 1000 / speed} for c in (1, 16)}
        return {"server": server, "threads": threads, "runs": runs, "idle_rss_mb": 1, "busy_rss_mb": 2}

    results = [
        result("pagedserve", 1, 2.0),
        result("llama-server", 1, 1.0),
        result("pagedserve", 4, 4.0),
        result("llama-server", 4, 8.0),
    ]
    text = report(results, args)
    assert text.count("| figure | pagedserve | llama-server | ours / theirs |") == 2
    assert "threads: 1" in text and "threads: 4" in text
    scaling = text.split("scaling: each cell pagedserve / llama-server (ratio)")[1]
    rows = [line for line in scaling.splitlines() if line.startswith("| 1 |") or line.startswith("| 4 |")]
    assert rows[0].startswith("| 1 | 2.0 / 1.0 (2.00x) | 50.0 / 100.0 (0.50x) | 500.0 / 1000.0 (0.50x) | 32.0 / 16.0")
    assert rows[1].startswith("| 4 | 4.0 / 8.0 (0.50x) | 25.0 / 12.5 (2.00x)")
    one = report(results[:2], args)  # one thread count: no scaling table
    assert "scaling" not in one and "| c=16: output tok/s | 32.0 | 16.0 | 2.00 (higher is better) |" in one


def test_the_report_names_the_kernel_target_ours_runs(monkeypatch):
    """A figure of ours is the figure of one kernel build: the report says which (PAGEDSERVE_CPU_ISA
    steps below the CPU's best, e.g. to compare AVX2 builds of both servers on an AVX-512 CPU)."""
    from models.layers import cpu_isa

    monkeypatch.setattr(cpu_isa, "read_cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx_vnni"}))
    args = build_parser().parse_args(["--model", "m.gguf", "--concurrency", "1"])
    results = [
        {
            "server": "pagedserve",
            "threads": 2,
            "runs": {1: {"output_tok_s": 1.0, "itl_p50_ms": 1.0, "ttft_p50_ms": 1.0}},
            "idle_rss_mb": 1,
            "busy_rss_mb": 1,
        }
    ]
    monkeypatch.delenv("PAGEDSERVE_CPU_ISA", raising=False)
    assert "; pagedserve kernels: avx2vnni (the CPU's best)" in report(results, args).splitlines()[0]
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx2")
    assert "; pagedserve kernels: avx2 (PAGEDSERVE_CPU_ISA=avx2)" in report(results, args).splitlines()[0]
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx512vnni")  # refused where the CPU lacks it: the best serves
    assert (
        "kernels: avx2vnni (PAGEDSERVE_CPU_ISA=avx512vnni refused: the CPU lacks it)"
        in report(results, args).splitlines()[0]
    )


@pytest.mark.slow
def test_ours_alone_on_a_tiny_gguf_reports_every_concurrency(tmp_path, capsys):
    from loadtest.make_gguf import tokenizer_fields, write_gguf
    from models.fetch import default_model_path

    model = write_gguf(
        tmp_path / "tiny-q4_0.gguf", "tiny", "q4_0", seed=1, tokenizer=tokenizer_fields(default_model_path())
    )
    out = tmp_path / "compare.json"
    main(
        [
            "--model",
            str(model),
            "--threads",
            "1",
            "--concurrency",
            "1",
            "2",
            "--requests-per-stream",
            "1",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--rounds",
            "2",
            "--out",
            str(out),
        ]
    )
    results = json.loads(out.read_text())["results"]
    assert [r["server"] for r in results] == ["pagedserve"]
    runs = results[0]["runs"]
    assert sorted(runs) == ["1", "2"] and all(run["completed"] == 16 and run["failed"] == 0 for run in runs.values())
    for run in runs.values():  # each figure the median of its rounds (of two: their mean)
        assert len(run["rounds"]) == 2
        assert run["itl_p50_ms"] == pytest.approx(sum(r["itl_p50_ms"] for r in run["rounds"]) / 2)
    assert results[0]["idle_rss_mb"] > 0 and results[0]["busy_rss_mb"] > 0
    assert "| c=2: output tok/s |" in capsys.readouterr().out
