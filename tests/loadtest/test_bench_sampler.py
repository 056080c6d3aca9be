"""loadtest.bench_sampler runs and prints a row for each setting and row count."""

import pytest

from loadtest import bench_sampler
from models.layers import cpu_kernels


def test_bench_sampler_prints_both_paths_for_every_setting(capsys):
    if not cpu_kernels.available():
        pytest.skip("no CPU kernels")
    bench_sampler.main(["--rows", "1", "--repeats", "3", "--threads", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| t=")]
    assert len(rows) == len(bench_sampler.SETTINGS)
    for line in rows:
        ours, torch_us, ratio = (float(cell) for cell in line.strip("| ").split(" | ")[2:])
        assert ours > 0 and torch_us > 0 and ratio == pytest.approx(ours / torch_us, rel=0.05, abs=0.01)
