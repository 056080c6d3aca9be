"""loadtest.bench_step runs its phases on a GGUF as the server loads it, and --profile breaks each
forward down by op: what a many-core run reads to see which ops stop scaling."""

from __future__ import annotations

import pytest

from loadtest import bench_step
from loadtest.make_gguf import tokenizer_fields, write_gguf
from models.fetch import default_model_path
from models.layers import cpu_kernels


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_step") / "tiny-q4_0.gguf"
    return write_gguf(path, "tiny", "q4_0", seed=1, tokenizer=tokenizer_fields(default_model_path()))


@pytest.mark.slow
def test_phases_print_timings_and_profile_breaks_forwards_down_by_op(tiny_gguf, capsys):
    bench_step.main(
        ["--model", str(tiny_gguf), "--threads", "1", "--repeats", "1", "--phases", "decode,prefill", "--profile"]
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    phases = [i for i, line in enumerate(lines) if line.startswith("forward ")]
    assert [lines[i].split()[1] for i in phases] == ["decode", "decode", "decode", "prefill"]
    prefill = lines[phases[-1] + 1 :]
    assert prefill and all(line.startswith("    ") and line.endswith("calls") for line in prefill)
    shares = [float(line.split()[-3].rstrip("%")) for line in prefill]  # "<op> <t> ms <share>% <n> calls"
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 100.5
    if cpu_kernels.available():  # the model's linear layers are the kernel's
        calls = {line.split()[0]: int(line.split()[-2]) for line in prefill}
        # qkv, o and down x 2 layers, one call each per forward; gate_up with silu * up in one op
        assert calls["pagedserve::quant_linear"] == 3 * 2
        assert calls["pagedserve::quant_linear_silu_mul"] == 2
