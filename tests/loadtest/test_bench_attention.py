"""loadtest.bench_attention runs every case on each of its layers' caches and prints its table."""

import pytest
import torch

from loadtest import bench_attention
from models.layers import cpu_kernels


def test_a_case_runs_on_every_layer_cache():
    gen = torch.Generator().manual_seed(0)
    run = bench_attention.attention_case((4, 2, 8), [1, 1], [5, 20], gen, torch.float16, layers=3)
    outs = run()
    assert len(outs) == 3
    # the same query over caches of different random keys: three different results, each finite
    assert all(out.isfinite().all() for out in outs)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


def test_bench_attention_prints_a_row_per_shape(capsys):
    if not cpu_kernels.available():
        pytest.skip("no CPU kernels")
    argv = ["--tokens", "32", "--decodes", "2", "--layers", "2", "--kv-dtype", "float16", "--repeats", "1"]
    bench_attention.main([*argv, "--threads", "1"])
    out = capsys.readouterr().out
    assert "float16 cache, 2 layer(s)" in out and "| 2 decodes |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x 64)" in line]
    assert len(rows) == len(bench_attention.SHAPES)
    for line in rows:
        assert all(float(cell) > 0 for cell in line.strip("| ").split(" | ")[1:])
