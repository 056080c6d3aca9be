"""loadtest.report's thread-scaling plot: drawn from loadtest.compare's results (or figures copied
from a docs table in that shape), one panel per figure, no creation time in an SVG; the plot on
docs/benchmarks.md is the one its JSON draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.report import main, plot_scaling

ROOT = Path(__file__).resolve().parents[2]
SAVED = ROOT / "docs/plots/xeon-threads.json"


def test_plot_scaling_draws_an_svg_without_its_date_and_the_same_file_twice(tmp_path):
    pytest.importorskip("matplotlib")
    results = [
        {"server": server, "threads": t, "runs": {"1": {"itl_p50_ms": v * t, "ttft_p50_ms": None}}}
        for server, v in (("pagedserve", 1.0), ("llama-server", 2.0))
        for t in (1, 2, 4)
    ]
    first, second = tmp_path / "a.svg", tmp_path / "b.svg"
    plot_scaling(results, str(first), title="t")
    plot_scaling(results, str(second), title="t")
    text = first.read_text()
    assert "<svg" in text and "dc:date" not in text
    assert first.read_bytes() == second.read_bytes()


def test_the_docs_plot_is_drawn_from_its_committed_figures(tmp_path):
    pytest.importorskip("matplotlib")
    saved = json.loads(SAVED.read_text())
    assert {r["server"] for r in saved["results"]} == {"pagedserve", "llama-server"}
    out = tmp_path / "xeon-threads.svg"
    main([str(SAVED), str(out)])
    assert out.stat().st_size > 0
    assert "plots/xeon-threads.svg" in (ROOT / "docs/benchmarks.md").read_text()
