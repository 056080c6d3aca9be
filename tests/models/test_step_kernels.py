"""A step's choice of kernels is a value the layers receive, not torch's process-wide oneDNN
switch: only StepKernels.matmul touches the switch, for the one call that asked for torch's
own kernels, and puts it back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from models.layers.step_kernels import DEFAULT_KERNELS, StepKernels

ROOT = Path(__file__).resolve().parents[2]
_SWITCH = re.compile(r"mkldnn\.enabled\b|_[gs]et_mkldnn_enabled|mkldnn\.flags\(|mkldnn\.set_flags")


def test_torchs_kernels_switch_onednn_off_for_that_call_alone():
    assert torch.backends.mkldnn.enabled
    assert StepKernels(onednn=False).matmul(lambda: torch.backends.mkldnn.enabled) is False
    assert torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError):
        StepKernels(onednn=False).matmul(lambda: (_ for _ in ()).throw(RuntimeError("a failed matmul")))
    assert torch.backends.mkldnn.enabled
    assert DEFAULT_KERNELS.matmul(lambda: torch.backends.mkldnn.enabled) is True
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(StepKernels(onednn=False).matmul(torch.nn.functional.linear, x, w), x @ w.T)


def test_no_module_but_step_kernels_reads_or_sets_torchs_onednn_switch():
    allowed = ROOT / "models" / "layers" / "step_kernels.py"
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for package in ("engine", "models", "server", "loadtest")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != allowed
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if _SWITCH.search(line)
    ]
    assert offenders == []
