"""Loading a quantized layer takes its own bytes plus a bounded scratch, whatever its size.

A GGUF's output layer has as many rows as the vocabulary (150k for Qwen): repacked as one piece,
its bit planes (a byte a bit) took ~10 GB to load a 1.1 GB file. `to_panels` reorders a slice of
rows at a time and the 5/6-bit packing stays in uint8; this checks both give the same bytes as
the layer at once and that a large layer's load peaks at a small multiple of its size.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from models.layers import quantization as Q


def _weight(bits: int, n: int, k: int) -> Q.QuantizedWeight:
    g = torch.Generator().manual_seed(n * k + bits)
    w = torch.randn(n, k, generator=g)
    if bits == -4:  # Q4_K's form: sc and mn in each group's bytes, d and -dmin per 256
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        sc, mn = (torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g) for _ in range(2))
        d = torch.rand(n, k // 256, generator=g).half()
        return Q.QuantizedWeight(4, Q.with_sub_scales(Q.pack_int4(q), sc, mn), d, -d, k, sub_scales=True)
    if bits == 8:
        return Q.quantize_int8(w, 32)
    if bits == 6:
        return Q.quantize_int6(w)
    return Q.quantize_int4(w, bits=bits)


@pytest.mark.parametrize("bits", [*Q.BITS, -4])  # -4: 4 bits with K-quant sub-scales
@pytest.mark.parametrize("n", [1, 37, 64, 203])
def test_panels_made_a_slice_of_rows_at_a_time_equal_the_layer_at_once(monkeypatch, bits, n):
    qw = _weight(bits, n, 512)
    whole = Q._to_panels(qw)
    monkeypatch.setattr(Q, "_PANEL_CHUNK_BYTES", 1)  # a panel (8 rows) at a time
    sliced = Q.to_panels(qw)
    for a, b in zip(whole, sliced):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("bits", [5, 6])
def test_high_bit_packing_round_trips(bits):
    n, k = 9, 256
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    if bits == 6:
        sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8)
        back, sc_back = Q.unpack_int6(Q.pack_int6(q, sc), k)
        assert torch.equal(sc_back, sc)
    else:
        back = Q.unpack_int5(Q.pack_int5(q), k)
    assert torch.equal(back, q)
    # the high bits' plane as the kernel's layout defines it: bit j of the 5-bit plane (bits 2j, 2j + 1
    # of the 6-bit one) is bit 4 (bits 4, 5) of the group's value j
    per = bits - 4
    stored = (Q.pack_int5(q) if bits == 5 else Q.pack_int6(q, torch.zeros(n, k // 16, dtype=torch.int8))).view(
        n, k // 32, -1
    )[..., 16 : 16 + 4 * per]
    plane = sum(stored[..., i].to(torch.int64) << (8 * i) for i in range(4 * per))
    for j in range(32):
        want = (q.view(n, k // 32, 32)[..., j].to(torch.int64) >> 4) & ((1 << per) - 1)
        assert torch.equal((plane >> (per * j)) & ((1 << per) - 1), want)


@pytest.mark.parametrize("bits", [4, 6])
def test_a_large_layers_load_peaks_at_a_small_multiple_of_its_bytes(bits):
    # In a fresh process: its high-water mark is this layer's alone.
    script = textwrap.dedent(
        f"""
        import resource, torch
        from models.layers import quantization as Q
        n, k = 1 << 16, 1024
        g = torch.Generator().manual_seed(0)
        q = torch.randint(0, {1 << bits}, (n, k), dtype=torch.uint8, generator=g)
        if {bits} == 6:
            qw = Q.QuantizedWeight(6, Q.pack_int6(q, torch.ones(n, k // 16, dtype=torch.int8)),
                                   torch.ones(n, k // 256, dtype=torch.float16), None, k)
        else:
            qw = Q.QuantizedWeight(4, Q.pack_int4(q), torch.ones(n, k // 32), torch.zeros(n, k // 32), k)
        del q
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        stored = sum(t.nbytes for t in (qw.qweight, qw.scales, qw.mins) if t is not None)
        panels = Q.to_panels(qw)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(stored, (peak - before) * 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    stored, growth = map(int, out.split())
    # the panels themselves (about the stored bytes) plus the scratch of one slice of rows
    assert growth < 2 * stored + (64 << 20), f"to_panels of {stored} bytes grew the process by {growth}"
