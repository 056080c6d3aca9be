"""AMX's int8 tiles (the `avx512amx` build; steps of 16 rows or more, 32 for 8 and 5 bits; each int16
activation as its two bytes): every format they take gives every row the bits it gets from the wide tiles
(PAGEDSERVE_AMX_TILES=0, themselves held to the 8-lane tiles' bits by test_wide_tiles and test_quantization),
at every row count and offset around the 16-row tiles, odd panel counts, K past one group, 1-3 threads, and
the fused silu. Runs where the CPU has AMX and Linux grants this process the tiles; elsewhere the products
still compile with the target's flags (test_cpu_isa) and the same rows take the wide tiles."""

from __future__ import annotations

import ctypes
import os
from unittest import mock

import pytest
import torch

from models.layers import cpu_kernels
from models.layers import quantization as Q
from tests.models.test_quantization import needs_kernel

SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


def amx_runs() -> bool:
    if not cpu_kernels.available() or cpu_kernels.loaded_target() != "avx512amx":
        return False
    return ctypes.CDLL(None).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def weight(kind: str, n: int, k: int) -> tuple[Q.QuantizedWeight, float]:
    """A random weight in one of the forms AMX's tiles take, its factors float16 as GGUF's, and its
    min_per_scale (Q4_0's folded -8, Q5_0's -16; else 0)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    if kind in ("q4_k", "q5_k"):
        return Q.quantize_k(w, 256, bits=int(kind[1])), 0.0
    if kind in ("iq4_nl", "iq4_xs"):
        return Q.quantize_iq4(w, 32 if kind == "iq4_nl" else 256, sub_scales=kind == "iq4_xs"), 0.0
    bits = {"int8": 8, "int4": 4, "q4_0": 4, "int5": 5, "q5_0": 5}[kind]
    qw = Q.quantize_int8(w, 32) if bits == 8 else Q.quantize_int4(w, 32, bits=bits)
    mins = None if qw.mins is None else qw.mins.half()
    qw = Q.QuantizedWeight(qw.bits, qw.qweight, qw.scales.half(), mins, k)
    if kind in ("q4_0", "q5_0"):
        zero_point = -float(1 << (bits - 1))
        return Q.QuantizedWeight(bits, qw.qweight, qw.scales, None, k), zero_point
    return qw, 0.0


@pytest.mark.parametrize("kind", ["int8", "int4", "q4_0", "int5", "q5_0", "q4_k", "q5_k", "iq4_nl", "iq4_xs"])
def test_amx_tiles_give_each_row_the_bits_of_the_wide_tiles(kind):
    needs_kernel()
    if not amx_runs():
        pytest.skip("no AMX here (or not granted to this process): the avx512amx build does not run")
    failures = []
    threads = torch.get_num_threads()
    try:
        for n, k in ((37, 512), (200, 768), (64, 2304)):  # odd panels; whole tiles and a last pair; long K
            qw, min_per_scale = weight(kind, n, k)
            qweight, scales, mins = Q.to_panels(qw)
            mins = None if min_per_scale else mins
            code = qw.bits | (Q.TABLE_KIND if qw.table else 0)
            bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
            x = torch.randn(300, k, generator=torch.Generator().manual_seed(n)) * 3
            x[0, 5] = 70.0  # a high byte far from the others'

            def product(rows: torch.Tensor) -> torch.Tensor:
                return cpu_kernels.quant_linear(
                    rows, qweight, scales, mins, bias, code, qw.group_size, n, min_per_scale
                )

            with mock.patch.dict(os.environ, {"PAGEDSERVE_AMX_TILES": "0"}):
                torch.set_num_threads(2)
                wide = product(x)
            for num_threads in (1, 2, 3):
                torch.set_num_threads(num_threads)
                for rows in (16, 17, 31, 32, 47, 48, 63, 64, 65, 100, 143, 300):
                    for start in (0, 1, 300 - rows):
                        if not torch.equal(product(x[start : start + rows]), wide[start : start + rows]):
                            failures.append((n, k, num_threads, rows, start))
    finally:
        torch.set_num_threads(threads)
    assert not failures, failures


def test_amx_tiles_fused_silu_gives_the_wide_tiles_bits():
    needs_kernel()
    if not amx_runs():
        pytest.skip("no AMX here (or not granted to this process): the avx512amx build does not run")
    n, k = 2 * 96, 768  # [gate | up], 12 panels each
    qw, _ = weight("q4_k", n, k)
    qweight, scales, mins = Q.to_panels(qw)
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(3))
    fused = torch.ops.pagedserve.quant_linear_silu_mul
    with mock.patch.dict(os.environ, {"PAGEDSERVE_AMX_TILES": "0"}):
        wide = fused(x, qweight, scales, mins, None, qw.bits, qw.group_size, n)
    got = fused(x, qweight, scales, mins, None, qw.bits, qw.group_size, n)
    assert torch.equal(got, wide)
    assert torch.equal(got[:20], fused(x[:20], qweight, scales, mins, None, qw.bits, qw.group_size, n))
