"""pagedserve against llama.cpp's llama-server on one GGUF file, side by side, same client.

    python -m loadtest.compare --llama-server ~/.cache/llama.cpp-0.3.36/llama.cpp/build/bin/llama-server
    python -m loadtest.compare                   # ours alone
    python -m loadtest.compare --llama-server PATH --model smollm2-1.7b:q4_0   # a random-weight 1.7B shape
    python -m loadtest.compare --llama-server PATH --model smollm2-360m:q4_0 --rounds 3   # medians of 3, alternating
    python -m loadtest.compare --llama-server PATH --model some/model.gguf
    python -m loadtest.compare --llama-server PATH --model qwen2.5-coder-0.5b-instruct   # by name, fetched
    python -m loadtest.compare --llama-server PATH --model smollm2-1.7b:q4_0 --threads 1 4 8 16   # thread scaling

`--model` is the GGUF both servers serve (default: SmolLM2-135M-Instruct Q4_1), a model's
name (models/catalog.py, fetched into the cache on first use), or SHAPE:TYPE, a random-weight
file of `loadtest.make_gguf`, written into the cache first if missing.

Each server is started on a free 127.0.0.1 port with the same threads and the same KV
capacity (llama-server `-c CTX -np SLOTS`, ours `--num-kv-blocks CTX/16 --max-num-seqs SLOTS`,
and `--device cpu` unless --device says otherwise: on a GPU machine ours would take the GPU),
its idle resident memory read from /proc once it is healthy, then `python -m loadtest`'s
benchmark runs each concurrency (streaming /v1/completions, fixed-length prompts,
`ignore_eos`) on one server and then on the other, which goes first alternating (both are up
at once; `--sequential` starts one at a time), and the servers are stopped by their own
handles. Prints one table with the CPU model and ISA flags, and writes every figure as JSON
with --out.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from loadtest.benchmark import run_benchmark
from loadtest.config import BenchmarkConfig
from loadtest.metrics import step_totals, step_totals_delta

ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_description() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    return f"{model}, {os.cpu_count()} cores; {' '.join(f for f in ISA_FLAGS if f in flags) or 'no AVX2'}"


def kernel_target() -> str:
    """The CPU kernels' target our server picks here (models/layers/cpu_kernels.py): the CPU's best,
    or PAGEDSERVE_CPU_ISA's where the CPU runs it. The server inherits this process's environment."""
    from models.layers import cpu_isa, cpu_kernels

    if not cpu_kernels.enabled():
        return "off (PAGEDSERVE_CPU_KERNELS=0: the PyTorch paths)"
    requested = cpu_kernels.requested_target()
    choice = cpu_isa.choose(cpu_isa.read_cpu_flags(), requested)
    if not requested:
        return f"{choice.target.name} (the CPU's best)"
    return (
        f"{choice.target.name} (PAGEDSERVE_CPU_ISA={requested}{' refused: the CPU lacks it' if choice.refused else ''})"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def huge_pages_mb(pid: int) -> float | None:
    """The process's memory on transparent huge pages (AnonHugePages), MB: our weights and KV cache
    ask for them (models/layers/hugepages.py) and get them only where the kernel finds free 2 MB runs."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def stop_server(process: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM the server we started (by its handle), SIGKILL it if it has not drained in `timeout`."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def server_commands(args: argparse.Namespace, port: int, threads: int | None = None) -> dict[str, list[str]]:
    """Each server's command line, both with `threads` threads (None: all cores)."""
    commands = {
        "pagedserve": [
            sys.executable,
            "-m",
            "server",
            "--model",
            str(args.model),
            "--port",
            str(port),
            "--served-model-name",
            "model",
            "--num-kv-blocks",
            str(args.ctx // 16),
            "--max-num-seqs",
            str(args.slots),
            "--quantization",
            args.quantization,
            "--log-level",
            "warning",
            "--device",
            args.device,
            *(["--num-threads", str(threads)] if threads else []),
        ],
    }
    if args.llama_server:
        commands["llama-server"] = [
            str(args.llama_server),
            "-m",
            str(args.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(args.ctx),
            "-np",
            str(args.slots),
            "-t",
            str(threads or os.cpu_count()),
            "-a",
            "model",
            "--log-disable",
        ]
    return commands


@contextlib.contextmanager
def side_by_side(commands: dict[str, list[str]]) -> Iterator[tuple[dict[str, str], dict[str, subprocess.Popen]]]:
    """Start every server (each command names its `--port`), wait until all are healthy and settled,
    and give their URLs and processes; each is stopped by its own handle however the block ends.
    An idle server waits on its sockets and uses no CPU (0-1 ticks in 5 s, measured for ours and for
    llama-server), so what one server does while the other idles is its own figure."""
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name, command in commands.items():
            print(f"{name}: {' '.join(command)}", flush=True)
            processes[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        urls = {name: f"http://127.0.0.1:{command[command.index('--port') + 1]}" for name, command in commands.items()}
        for name, process in processes.items():
            wait_healthy(urls[name], process)
        time.sleep(2.0)  # let start-up work (kernel loads, first allocations) settle
        yield urls, processes
    finally:
        for process in processes.values():
            stop_server(process)


FIGURES = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")


def merge_rounds(rounds: list[dict]) -> dict:
    """One concurrency's rounds on one server -> each figure's median over the rounds (the others
    summed), with the rounds themselves under "rounds"."""
    merged = {
        key: statistics.median(r[key] for r in rounds) if all(r[key] is not None for r in rounds) else None
        for key in FIGURES
    }
    for key in ("completed", "failed", "stale_connection_retries"):
        merged[key] = sum(r[key] for r in rounds)
    merged["failures"] = dict(sum((collections.Counter(r["failures"]) for r in rounds), collections.Counter()))
    merged["first_error_by_kind"] = next((r["first_error_by_kind"] for r in rounds if r["first_error_by_kind"]), {})
    merged["rounds"] = [
        {
            **{key: r[key] for key in FIGURES},
            "steps_by_threads": r.get("steps_by_threads", {}),
            "huge_pages_mb": r.get("huge_pages_mb"),
        }
        for r in rounds
    ]
    return merged


def measure(
    commands: dict[str, list[str]], args: argparse.Namespace, tokenizer_dir: str, threads: int | None = None
) -> list[dict]:
    """Run each concurrency on one server and at once on the other (side_by_side), alternating which
    goes first: the two figures of a row come minutes closer than whole runs one after the other,
    and a shared machine's speed drifts over minutes (by a third between runs minutes apart). With --rounds N, all of that N times on servers started afresh each round (a
    llama-server that had served a round kept its finished requests' cache cells, and its c=16
    throughput fell by a fifth to a third: each decode attends over the cells in use),
    which server goes first alternating from round to round too, each round its own prompts (the
    same for both servers: a prompt of an earlier round would come from a prefix cache), and each
    figure the median of its N. One result per server, in the order given."""
    results: dict[str, dict[str, Any]] = {
        name: {"server": name, "threads": threads or os.cpu_count(), "command": command, "runs": {}}
        for name, command in commands.items()
    }
    names = list(commands)
    rounds: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    for round_index in range(args.rounds):
        with side_by_side(commands) as (urls, processes):
            if round_index == 0:
                for name, process in processes.items():
                    results[name]["idle_rss_mb"] = rss_mb(process.pid)
            for i, concurrency in enumerate(args.concurrency):
                for name in names if (i + round_index) % 2 == 0 else names[::-1]:
                    config = BenchmarkConfig(
                        url=urls[name],
                        model="model",
                        concurrency=concurrency,
                        num_requests=max(args.requests_per_stream * concurrency, 8),
                        warmup=min(concurrency, 4),
                        input_len=args.input_len,
                        output_len=args.output_len,
                        ignore_eos=True,
                        tokenizer=tokenizer_dir,
                        server_metrics=False,
                        seed=concurrency + 1009 * round_index,
                    )
                    before = step_totals(urls[name])
                    summary = asyncio.run(run_benchmark(config))["summary"]
                    run = {
                        "output_tok_s": summary["output_token_throughput"],
                        "ttft_p50_ms": summary["ttft_ms"]["p50"],
                        "itl_p50_ms": summary["itl_ms"]["p50"],
                        "completed": summary["completed"],
                        "failed": summary["failed"],
                        "failures": summary["failures"],
                        "stale_connection_retries": summary["stale_connection_retries"],
                        "first_error_by_kind": summary["first_error_by_kind"],
                        # ours: the run's steps by thread count (the tuner's choice, engine/threads.py)
                        "steps_by_threads": step_totals_delta(before, step_totals(urls[name])),
                        "huge_pages_mb": huge_pages_mb(processes[name].pid),
                    }
                    rounds[name, concurrency].append(run)
                    shown = {k: v for k, v in run.items() if k != "first_error_by_kind"}
                    tag = f" round {round_index + 1}/{args.rounds}" if args.rounds > 1 else ""
                    print(f"  {name} c={concurrency}{tag}: {shown}", flush=True)
            if round_index == args.rounds - 1:
                for name, process in processes.items():
                    results[name]["busy_rss_mb"] = rss_mb(process.pid)
    for (name, concurrency), runs in rounds.items():
        results[name]["runs"][concurrency] = merge_rounds(runs)
    return list(results.values())


def report(results: list[dict], args: argparse.Namespace) -> str:
    """One table per thread count (each server's figures side by side, ours / theirs), and with
    several counts and two servers, how each figure scales with the threads."""
    lines = [
        f"CPU: {cpu_description()}" + (f"; pagedserve kernels: {kernel_target()}" if args.device == "cpu" else ""),
        f"model: {Path(args.model).name}; prompts {args.input_len} tokens, {args.output_len} generated, "
        f"streaming /v1/completions, ignore_eos; KV capacity {args.ctx} tokens, {args.slots} slots",
    ]
    counts = list(dict.fromkeys(r["threads"] for r in results))
    figures = [
        ("output tok/s", "output_tok_s", ".1f", True),
        ("ITL p50 ms", "itl_p50_ms", ".1f", False),
        ("TTFT p50 ms", "ttft_p50_ms", ".1f", False),
    ]

    def ratio(values: list[float], higher_is_better: bool) -> str:
        return f"{values[0] / values[1]:.2f}" + (" (higher is better)" if higher_is_better else "")

    for threads in counts:
        group = [r for r in results if r["threads"] == threads]
        names = [r["server"] for r in group]
        header = "| figure | " + " | ".join(names) + (" | ours / theirs |" if len(names) == 2 else " |")
        lines += ["", f"threads: {threads}", "", header, "|---" * (len(names) + 1 + (len(names) == 2)) + "|"]

        def row(label: str, values: list[float], fmt: str, higher_is_better: bool) -> None:
            cells = [format(v, fmt) if v is not None else "-" for v in values]
            tail = f" | {ratio(values, higher_is_better)}" if len(values) == 2 and all(values) else ""
            lines.append(f"| {label} | " + " | ".join(cells) + tail + " |")

        for c in args.concurrency:
            runs = [r["runs"][c] for r in group]
            for label, key, fmt, higher in figures:
                row(f"c={c}: {label}", [x[key] for x in runs], fmt, higher)
        row("idle RSS MB", [r["idle_rss_mb"] for r in group], ".0f", False)
        row("RSS after the runs MB", [r["busy_rss_mb"] for r in group], ".0f", False)

    names = list(dict.fromkeys(r["server"] for r in results))
    if len(counts) > 1 and len(names) == 2:
        lines += [
            "",
            f"scaling: each cell {names[0]} / {names[1]} (ratio)",
            "",
            "| threads | " + " | ".join(f"c={c}: {label}" for c in args.concurrency for label, *_ in figures) + " |",
            "|---" * (1 + len(args.concurrency) * len(figures)) + "|",
        ]
        for threads in counts:
            ours, theirs = (next(r for r in results if r["threads"] == threads and r["server"] == n) for n in names)
            cells = []
            for c in args.concurrency:
                for _, key, fmt, higher in figures:
                    pair = [ours["runs"][c][key], theirs["runs"][c][key]]
                    cells.append(
                        f"{format(pair[0], fmt)} / {format(pair[1], fmt)}"
                        + (f" ({pair[0] / pair[1]:.2f}x)" if all(pair) else "")
                    )
            lines.append(f"| {threads} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def resolve_model(text: str | None) -> Path:
    """--model: None -> the default model's GGUF; SHAPE:TYPE -> make_gguf's file (written if
    missing); else what models.fetch resolves it to (a model's name: fetched), which must be a file."""
    from loadtest.make_gguf import SHAPES, TYPES, ensure_gguf, parse_shortcut
    from models.fetch import default_model_path, resolve_model_path

    if text is None:
        return default_model_path()
    if shortcut := parse_shortcut(text):
        return ensure_gguf(*shortcut)
    try:
        path = resolve_model_path(text)
    except FileNotFoundError as exc:
        raise ValueError(
            f"--model {text!r}: {exc}; nor SHAPE:TYPE with a shape of {', '.join(sorted(SHAPES))} "
            f"and a type of {', '.join(sorted(TYPES))}"
        ) from None
    if not path.is_file():
        raise ValueError(f"--model {text!r}: {path} is not a .gguf file (llama-server serves GGUF files)")
    return path


def check_executable(text: str) -> Path:
    """--llama-server must name a program: an empty or wrong path would otherwise surface as
    a bare 'Permission denied' (or '.': 'Is a directory') from Popen."""
    path = Path(text).expanduser()
    if not text.strip() or not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(
            f"--llama-server {text!r}: no executable file there; build llama.cpp's llama-server "
            "(cmake -DLLAMA_BUILD_SERVER=ON) and pass the binary's path"
        )
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (else ours alone)")
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file, a model's name (python -m models.fetch --list), or SHAPE:TYPE (e.g. "
        "smollm2-360m:q4_0) for loadtest.make_gguf's random-weight file "
        "(default: SmolLM2-135M-Instruct Q4_1)",
    )
    p.add_argument("--quantization", default="auto", help="ours: --quantization")
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="both servers' threads (default: all cores); several counts run one after the other, "
        "and the report adds how each figure scales",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="ours: --device (default cpu, where llama-server runs; ours would take a GPU if one is there)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests = this x concurrency (at least 8)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every concurrency on both servers this many times, on servers started afresh each "
        "round, alternating, and report each figure's median (this machine's speed drifts by tens of "
        "percent over minutes: use 3 or more for a ratio to quote)",
    )
    p.add_argument("--ctx", type=int, default=16384, help="KV capacity in tokens, both servers")
    p.add_argument("--slots", type=int, default=64, help="parallel sequences, both servers")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="start one server at a time (default: both side by side, each concurrency run on one "
        "and then on the other; needs memory for both)",
    )
    p.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="with several --threads: each figure against the threads, a line per server (PNG or SVG)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if args.llama_server is not None:
            args.llama_server = check_executable(args.llama_server)
        args.model = resolve_model(args.model)
    except ValueError as exc:
        p.error(str(exc))

    from models.gguf import load_tokenizer

    results = []
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        load_tokenizer(args.model).save_pretrained(tokenizer_dir)  # one client-side tokenizer for both
        for threads in args.threads or [None]:
            commands = {
                name: server_commands(args, free_port(), threads)[name] for name in server_commands(args, 0, threads)
            }
            if args.sequential:  # one server at a time (where memory holds only one)
                for name, command in commands.items():
                    results += measure({name: command}, args, tokenizer_dir, threads)
            else:
                results += measure(commands, args, tokenizer_dir, threads)
    text = report(results, args)
    print("\n" + text)
    if args.out:
        args.out.write_text(
            json.dumps(
                {"cpu": cpu_description(), "kernels": kernel_target(), "results": results, "table": text}, indent=2
            )
        )
    if args.plot:
        from loadtest.report import plot_scaling

        plot_scaling(results, str(args.plot), title=f"{Path(args.model).name} on {cpu_description()}")


if __name__ == "__main__":
    main()
