"""Presenting results: a progress bar while running, a terminal table, a JSON
file, and plots (matplotlib, from the `plot` extra, imported only when asked).
"""

from __future__ import annotations

import json
import math
import sys
import time
from types import ModuleType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_WIDTH = 56
_LATENCIES = (
    ("ttft_ms", "Time to first token"),
    ("tpot_ms", "Time per output token (excl. 1st)"),
    ("itl_ms", "Inter-token latency"),
    ("e2e_ms", "End-to-end latency"),
)


class ProgressBar:
    """Plain-stderr progress, no dependency: redrawn in place on a terminal, a
    line every few seconds otherwise (CI logs). Redraws are throttled because
    they run on the benchmark's event loop, between request completions."""

    def __init__(self, total: int, stream: TextIO | None = None):
        self.total, self.done, self.failed = total, 0, 0
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._interval = 0.1 if self._tty else 5.0
        self._start = self._last = time.perf_counter()

    def update(self, failed: bool = False) -> None:
        self.done += 1
        self.failed += failed
        now = time.perf_counter()
        if now - self._last >= self._interval or self.done == self.total:
            self._last = now
            self._draw(now)

    def close(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self, now: float) -> None:
        filled = int(30 * self.done / max(self.total, 1))
        line = (
            f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
            f"{self.failed} failed  {now - self._start:.1f}s"
        )
        self._stream.write(("\r" + line) if self._tty else (line + "\n"))
        self._stream.flush()


def _fmt(value: object, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(result: dict) -> str:
    """vLLM benchmark_serving-style result block for one run."""
    s, server = result["summary"], result.get("server")
    lines = [" Serving Benchmark Result ".center(_WIDTH, "=")]

    def row(label: str, value: object, digits: int = 2) -> None:
        lines.append(f"{label + ':':<42}{_fmt(value, digits):>14}")

    row("Successful requests", s["completed"])
    row("Failed requests", s["failed"])
    for kind, count in sorted(s["failures"].items()):
        row(f"  {kind}", count)
    if s["disconnected"]:
        row("Disconnected on purpose", s["disconnected"])
    if s.get("stale_connection_retries"):
        row("Resent: kept-alive connection closed", s["stale_connection_retries"])
    row("Benchmark duration (s)", s["duration_s"])
    row("Total input tokens", s["total_input_tokens"])
    row("Total generated tokens", s["total_output_tokens"])
    row("Request throughput (req/s)", s["request_throughput"])
    row("Input token throughput (tok/s)", s["input_token_throughput"])
    row("Output token throughput (tok/s)", s["output_token_throughput"])
    row("Total token throughput (tok/s)", s["total_token_throughput"])
    if s["goodput"]:
        row("Request goodput (req/s)", s["goodput"]["request_goodput"])
    for key, title in _LATENCIES:
        lines.append(f" {title} ".center(_WIDTH, "-"))
        for stat in ("mean", "p50", "p90", "p99"):
            row(f"{stat.capitalize() if stat == 'mean' else stat.upper()} {key[:-3].upper()} (ms)", s[key][stat])
    if server:
        lines.append(" Server /metrics (during the run) ".center(_WIDTH, "-"))
        for key, label in (("ttft", "TTFT"), ("itl", "ITL")):
            if server[key]:
                client_mean = s["ttft_ms" if key == "ttft" else "itl_ms"]["mean"]
                row(f"Mean {label} server / client (ms)", f"{_fmt(server[key]['mean_ms'])} / {_fmt(client_mean)}")
        for key, g in server["gauges"].items():
            row(f"{key} before -> after", f"{_fmt(g['before'])} -> {_fmt(g['after'])}")
        row("Gauges back to idle", "yes" if server["returned_to_idle"] else "NO")
    lines.append("=" * _WIDTH)
    if s["first_error_by_kind"]:
        lines.append("First error of each kind:")
        lines += [f"  {kind}: {msg[:200]}" for kind, msg in sorted(s["first_error_by_kind"].items())]
    return "\n".join(lines)


def format_turn_table(result: dict) -> str:
    """A multi-turn run's TTFT by turn index (loadtest.multi_turn), and its replay's beside it."""
    replay = result.get("replay")
    header = f"{'turn':>4} {'done':>5} {'prompt tok':>10} {'TTFT p50':>9} {'TTFT mean':>9}"
    if replay:
        header += f" {'replay p50':>10} {'replay mean':>11} {'replay/first':>12}"
    lines = [" TTFT by turn (ms) ".center(len(header), "-"), header]
    for i, t in enumerate(result["turns"]):
        line = (
            f"{t['turn']:>4} {t['completed']:>5} {_fmt(t['mean_prompt_tokens'], 0):>10} "
            f"{_fmt(t['ttft_ms']['p50'], 1):>9} {_fmt(t['ttft_ms']['mean'], 1):>9}"
        )
        if replay:
            r = replay["turns"][i]["ttft_ms"]
            first = t["ttft_ms"]["p50"]
            ratio = r["p50"] / first if r["p50"] is not None and first else None
            line += f" {_fmt(r['p50'], 1):>10} {_fmt(r['mean'], 1):>11} {_fmt(ratio, 3):>12}"
        lines.append(line)
    return "\n".join(lines)


def format_sweep_table(sweep: dict) -> str:
    """One row per sweep point."""
    header = (
        f"{sweep['sweep']:>12} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'ITL p99':>9} {'E2E p50':>9} {'failed':>6}"
    )
    lines = [header, "-" * len(header)]
    for value, run in zip(sweep["values"], sweep["runs"], strict=True):
        s = run["summary"]
        lines.append(
            f"{_fmt(value):>12} {s['request_throughput']:>8.2f} {s['output_token_throughput']:>10.1f} "
            f"{_fmt(s['ttft_ms']['p50'], 1):>9} {_fmt(s['ttft_ms']['p99'], 1):>9} "
            f"{_fmt(s['tpot_ms']['p50'], 1):>9} {_fmt(s['itl_ms']['p99'], 1):>9} "
            f"{_fmt(s['e2e_ms']['p50'], 1):>9} {s['failed']:>6}"
        )
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    def finite(x: object) -> object:  # JSON has no inf/nan
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, list):
            return [finite(v) for v in x]
        return x

    with open(path, "w", encoding="utf-8") as f:
        json.dump(finite(result), f, indent=1)
        f.write("\n")


def require_matplotlib() -> ModuleType:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'pagedserve[plot]' (or pip install matplotlib)") from e
    return plt


def plot(result: dict, path: str) -> None:
    """Latency distributions for one run; throughput and latency against the
    swept value for a sweep."""
    plt = require_matplotlib()
    fig = _plot_sweep(plt, result) if "sweep" in result else _plot_distributions(plt, result)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_distributions(plt: ModuleType, result: dict) -> Figure:
    done = [r for r in result["requests"] if r["outcome"] == "completed"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title) in zip(axes.flat, _LATENCIES, strict=True):
        values = (
            [x for r in done for x in r["itl_ms"]] if key == "itl_ms" else [r[key] for r in done if r[key] is not None]
        )
        ax.set_title(title)
        ax.set_xlabel("ms")
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
            continue
        ax.hist(values, bins=50, color="tab:blue", alpha=0.8)
        for q, style in (("p50", "--"), ("p99", ":")):
            ax.axvline(
                result["summary"][key][q], color="black", linestyle=style, label=f"{q} {result['summary'][key][q]:.1f}"
            )
        ax.legend()
    fig.suptitle(f"{result['config']['model']} @ {result['config']['url']}")
    return fig


def _plot_sweep(plt: ModuleType, sweep: dict) -> Figure:
    xs = sweep["values"]
    summaries = [run["summary"] for run in sweep["runs"]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels: list[tuple[str, list[tuple[str, str | None]]]] = [
        ("Throughput (tok/s)", [("output_token_throughput", None), ("total_token_throughput", None)]),
        ("TTFT (ms)", [("ttft_ms", "p50"), ("ttft_ms", "p99")]),
        ("TPOT / ITL (ms)", [("tpot_ms", "p50"), ("itl_ms", "p99")]),
        ("End-to-end latency (ms)", [("e2e_ms", "p50"), ("e2e_ms", "p99")]),
    ]
    for ax, (title, series) in zip(axes.flat, panels, strict=True):
        for key, stat in series:
            ys = [s[key] if stat is None else s[key][stat] for s in summaries]
            ax.plot(
                xs,
                [math.nan if y is None else y for y in ys],
                marker="o",
                label=key.replace("_token_throughput", "") if stat is None else f"{key[:-3]} {stat}",
            )
        ax.set_title(title)
        ax.set_xlabel(sweep["sweep"].replace("_", " "))
        if all(0 < x < math.inf for x in xs) and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)  # sweeps usually double the load
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    config = sweep["runs"][0]["config"]
    fig.suptitle(f"{config['model']} @ {config['url']}")
    return fig


# loadtest.compare's figures a run: (key, panel title).
_COMPARED = (("itl_p50_ms", "ITL p50 (ms)"), ("ttft_p50_ms", "TTFT p50 (ms)"), ("output_tok_s", "output tok/s"))


def plot_scaling(results: list[dict], path: str, title: str = "") -> None:
    """loadtest.compare's results over several thread counts: a panel per figure and concurrency,
    each figure against the threads, a line per server. Its JSON (`--output`) or figures copied
    from a table in the same shape: [{"server", "threads", "runs": {concurrency: {figure: value}}}]."""
    plt = require_matplotlib()
    servers = list(dict.fromkeys(r["server"] for r in results))
    concurrencies = list(dict.fromkeys(c for r in results for c in r["runs"]))
    panels = [
        (c, key, label)
        for c in concurrencies
        for key, label in _COMPARED
        if any(r["runs"].get(c, {}).get(key) is not None for r in results)
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (c, key, label) in zip(axes.flat, panels, strict=True):
        for server in servers:
            points = sorted(
                (r["threads"], r["runs"][c][key])
                for r in results
                if r["server"] == server and r["runs"].get(c, {}).get(key) is not None
            )
            ax.plot([t for t, _ in points], [v for _, v in points], marker="o", label=server)
        threads = sorted({r["threads"] for r in results})
        ax.set_xscale("log", base=2)
        ax.set_xticks(threads, [str(t) for t in threads])
        ax.minorticks_off()
        ax.set_title(f"c={c}: {label}")
        ax.set_xlabel("threads")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    svg = str(path).endswith(".svg")
    # An SVG without its creation time and with fixed ids: the same figures make the same file.
    with plt.rc_context({"svg.hashsalt": "loadtest"} if svg else {}):
        fig.savefig(path, metadata={"Date": None} if svg else None)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """python -m loadtest.report COMPARE.json OUT.svg: plot_scaling of a saved `loadtest.compare --out` file."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loadtest.report", description=main.__doc__)
    parser.add_argument("compare_json", help="loadtest.compare --out's file: {cpu, results, ...}")
    parser.add_argument("out", help="the plot, PNG or SVG by its suffix")
    parser.add_argument("--title", default=None, help="default: the file's model and cpu")
    args = parser.parse_args(argv)
    with open(args.compare_json) as f:
        saved = json.load(f)
    title = (
        args.title if args.title is not None else " on ".join(x for x in (saved.get("model"), saved.get("cpu")) if x)
    )
    plot_scaling(saved["results"], args.out, title=title)


if __name__ == "__main__":
    main()
