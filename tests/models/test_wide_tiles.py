"""The quantized kernel's 16-lane tiles (AVX-512 VNNI builds: two panels a vector, for a lone row
and for steps of more) give every row the bits the 8-lane tiles give it alone, for 4, 5, 6 (Q6_K:
two sub-blocks a group, one pass or two) and 8 bits, Q4_0's folded -8 (Q5_0's -16), Q4_K's, Q5_K's and
Q2_K's sub-scales, IQ4_NL's and IQ4_XS's table, float16 and float32 factors, groups of 32 and 64, and
every edge (rows and panels not multiples of the tile, N not a multiple of 8, K past one group). Where the CPU has no
AVX-512, the same source is built with its 512-bit intrinsics emulated lane by lane
(csrc/wide_tiles_emulated.cpp); where it has, test_quantization's row-invariance test runs them on
the real instructions (rows alone on the 8-lane tiles, PAGEDSERVE_WIDE_TILES=0, against the wide ones)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch.utils.cpp_extension import get_cxx_compiler

from models.layers import cpu_isa

pytestmark = pytest.mark.slow  # builds the kernels with 512-bit intrinsics emulated

HARNESS = Path(__file__).parent / "csrc" / "wide_tiles_emulated.cpp"

CHECK = textwrap.dedent(
    """
    import os, sys, torch
    from torch.utils.cpp_extension import load
    # The kernel's source is #included, which torch's build cache does not hash: its digest goes in a flag.
    load(name="pagedserve_wide_tiles_emulated", sources=[sys.argv[1]], is_python_module=False,
         extra_cflags=["-O2", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-DKERNEL_SOURCE=" + sys.argv[2]],
         extra_ldflags=["-fopenmp"])
    import models.layers.quantization as Q
    op = torch.ops.pagedserve.quant_linear
    torch.set_num_threads(2)
    failures = []
    for bits, q4_0, k, n, group, factors in [(4, False, 576, 37, 32, torch.float32), (4, True, 576, 37, 32, torch.float16),
                                              (8, False, 576, 37, 32, torch.float16), (4, False, 256, 64, 64, torch.float16),
                                              (4, True, 3136, 48, 32, torch.float16), (8, False, 128, 40, 32, torch.float32),
                                              (4, False, 128, 200, 32, torch.float32), (5, False, 576, 37, 32, torch.float32),
                                              (5, True, 256, 64, 32, torch.float16), (5, False, 3136, 48, 64, torch.float16),
                                              (6, False, 512, 37, 256, torch.float16), (6, False, 768, 48, 256, torch.float32),
                                              (6, False, 256, 203, 256, torch.float16),
                                              (4, "k", 768, 37, 256, torch.float16), (5, "k", 512, 203, 256, torch.float16),
                                              (2, "k", 768, 37, 256, torch.float16), (2, "k", 512, 203, 256, torch.float16),
                                              (4, "iq4", 576, 37, 32, torch.float16), (4, "iq4", 768, 203, 256, torch.float16)]:
        gen = torch.Generator().manual_seed(k + n)
        w = torch.randn(n, k, generator=gen)
        if bits == 2:  # Q2_K's form, from random blocks: fp16 d and -dmin per 256, its scale bytes per 16
            from tests.models.test_q2_k_as_stored import q2k_blocks
            from models.gguf import quantized_weight
            from gguf import GGMLQuantizationType
            qw, q4_0 = quantized_weight(q2k_blocks(w.numpy()), GGMLQuantizationType.Q2_K, n, k), False
        elif q4_0 == "k":  # Q4_K's, Q5_K's form: fp16 d and -dmin per 256, sc and mn in the groups' bytes
            qw, q4_0 = Q.quantize_k(w, group, bits=bits), False
        elif q4_0 == "iq4":  # IQ4_NL's (group 32), IQ4_XS's (256: ls - 32 in the groups' bytes) table form
            qw, q4_0 = Q.quantize_iq4(w, group, sub_scales=group > 32), False
        elif bits == 6:
            qw = Q.quantize_int6(w, group)
        else:
            qw = Q.quantize_int8(w, group) if bits == 8 else Q.quantize_int4(w, group, bits=bits)
        mins = None if qw.mins is None else qw.mins.to(factors)
        qw = Q.QuantizedWeight(qw.bits, qw.qweight, qw.scales.to(factors), mins, k, qw.sub_scales, qw.table)
        zero_point = -float(1 << (bits - 1))  # Q4_0's -8, Q5_0's -16
        if q4_0:
            qw = Q.QuantizedWeight(bits, qw.qweight, qw.scales, qw.scales * zero_point, k)
        qweight, scales, mins = Q.to_panels(qw)
        mins, min_per_scale = (None, zero_point) if q4_0 else (mins, 0.0)
        bias = torch.randn(n, generator=gen)
        x = torch.randn(300, k, generator=gen) * 3
        x[0, 5] = 70.0
        case = (bits, "q4_0" if q4_0 else "iq4" if qw.table else "k" if qw.sub_scales else "", k, n, group, str(factors))
        kind = bits | (Q.TABLE_KIND if qw.table else 0)
        f = lambda xs: op(xs, qweight, scales, mins, bias, kind, qw.group_size, n, min_per_scale)
        os.environ["PAGEDSERVE_WIDE_TILES"] = "0"  # read at every product
        alone = torch.cat([f(x[i : i + 1]) for i in range(300)])  # the 8-lane tiles
        os.environ["PAGEDSERVE_WIDE_TILES"] = "1"
        if not torch.equal(torch.cat([f(x[i : i + 1]) for i in range(300)]), alone):  # a lone row's wide tile
            failures.append((case, 1, "alone"))
        blocks = x.view(300, k // 32, 32)
        d = blocks.abs().amax(-1, keepdim=True) / 32767
        x_rounded = (torch.round(blocks / d) * d).view(300, k)
        want = torch.nn.functional.linear(x_rounded.double(), qw.dequantize().double(), bias.double())
        error = ((alone.double() - want).abs().max() / want.abs().max()).item()
        if error > 1e-5:
            failures.append((case, "off the reference", error))
        for rows in (2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 64, 65, 300):
            for start in (0, 1, 5, 300 - rows):
                if not torch.equal(f(x[start : start + rows]), alone[start : start + rows]):
                    failures.append((case, rows, start))
    print("failures", failures)
    sys.exit(1 if failures else 0)
    """
)


def test_wide_tiles_give_each_row_the_bits_of_the_row_alone_emulated():
    flags = cpu_isa.read_cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("the emulation is built with AVX2 + FMA + F16C (the 256-bit half stays native)")
    if shutil.which(get_cxx_compiler()) is None:
        pytest.skip("no C++ compiler to build the emulation with")
    env = {key: value for key, value in os.environ.items() if key != "PAGEDSERVE_WIDE_TILES"}
    repo = Path(__file__).resolve().parents[2]
    csrc = repo / "models/layers/csrc"
    sources = [csrc / "quant_linear.cpp", *sorted(csrc.glob("*.h"))]  # the kernel and every header it includes
    kernel = hashlib.sha256(b"".join(source.read_bytes() for source in sources)).hexdigest()[:16]
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(HARNESS), kernel],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "failures []" in done.stdout
