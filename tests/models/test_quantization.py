"""Quantized weights: the kernels against the PyTorch reference, GGUF blocks against the gguf
package, and whole models served quantized against the same weights dequantized.

Tolerances are in units of float32's eps (the CPU's ISA changes the summation order, never
more), except where the kernel rounds activations to int16 on purpose (~1.5e-5 of a
32-value block's largest value per element).
"""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from models.gguf import quantized_weight, serving_format
from models.layers import cpu_kernels
from models.layers import quantization as Q
from models.layers.linear import Linear
from models.loader import load_model
from tests.models.conftest import paged_forward
from tests.models.test_gguf import random_k_blocks, tiny_llama, write_gguf

EPS = torch.finfo(torch.float32).eps
T = GGMLQuantizationType


def needs_kernel():
    if not cpu_kernels.available():
        pytest.skip("the C++ CPU kernels are not built here (no compiler, or PAGEDSERVE_CPU_KERNELS=0)")


def close_in_eps(got: torch.Tensor, want: torch.Tensor, ulps: float, k: int) -> None:
    """|got - want| <= ulps * eps * sqrt(K) * max|want|: summation-order differences only."""
    bound = ulps * EPS * k**0.5 * want.abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= bound, f"max diff {diff:.3g} > {bound:.3g}"


def random_quantized(bits: int, n: int, k: int, group: int | None, seed: int = 0) -> Q.QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if bits == 6:
        return Q.quantize_int6(w, group or 256)
    return Q.quantize_int8(w, group) if bits == 8 else Q.quantize_int4(w, group or 32, bits=bits)


ZERO_POINTS = {"q4_0": (4, -8), "q5_0": (5, -16)}  # GGUF's Q4_0 / Q5_0: w = d (q + m), no mins stored


def with_zero_point(qw: Q.QuantizedWeight, variant) -> Q.QuantizedWeight:
    """`qw` as a Q4_0 / Q5_0 weight (mins = m x scale, which the layer drops and the kernel folds
    into its integer sums) where `variant` names one, else as it is."""
    if variant not in ZERO_POINTS:
        return qw
    return Q.QuantizedWeight(qw.bits, qw.qweight, qw.scales, qw.scales * ZERO_POINTS[variant][1], qw.in_features)


def test_int4_packing_round_trips_in_gguf_order():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = Q.pack_int4(q)
    assert packed.shape == (3, 32)
    assert torch.equal(Q.unpack_int4(packed, 64), q)
    # GGUF's block order: byte j holds value j (low nibble) and value j + 16 (high nibble).
    assert packed[0, 0].item() == q[0, 0].item() | (q[0, 16].item() << 4)
    assert packed[0, 16].item() == q[0, 32].item() | (q[0, 48].item() << 4)


def test_int5_packing_round_trips_with_the_high_bits_behind_the_nibbles():
    q = torch.randint(0, 32, (3, 64), dtype=torch.uint8)
    packed = Q.pack_int5(q)
    assert packed.shape == (3, 40)  # 20 bytes a group of 32: 5 bits a value
    assert torch.equal(Q.unpack_int5(packed, 64), q)
    # a group: int4's 16 bytes of low nibbles, then Q5_0's qh (bit j: bit 4 of value j), little-endian
    assert torch.equal(packed[:, :16], Q.pack_int4(q[:, :32] & 15))
    qh = int.from_bytes(bytes(packed[0, 16:20].tolist()), "little")
    assert [qh >> j & 1 for j in range(32)] == (q[0, :32] >> 4).tolist()


@pytest.mark.parametrize("bits,group", [(8, None), (8, 32), (4, 32), (4, 64), (5, 32)])
def test_round_to_nearest_is_within_half_a_step(bits, group):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)) * 3
    qw = Q.quantize_int8(w, group) if bits == 8 else Q.quantize_int4(w, group, bits=bits)
    g = group or 128
    step = qw.scales.repeat_interleave(g, dim=1)  # (N, K)
    assert ((qw.dequantize() - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert qw.shape == (16, 128) and qw.group_size == g


def half_factors(qw: Q.QuantizedWeight) -> Q.QuantizedWeight:
    """The same weight with float16 scales and mins (as GGUF's Q4_0/Q4_1/Q8_0 store them)."""
    mins = None if qw.mins is None else qw.mins.half()
    return Q.QuantizedWeight(qw.bits, qw.qweight, qw.scales.half(), mins, qw.in_features)


@pytest.mark.parametrize("bits", [8, 4, 5])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_int16_activation_path_equals_its_emulation(bits, rows, scale_dtype):
    """quantize_input=True (the default) rounds x to int16 per 32 values: the result is the
    dequantized weight times that rounded x, which a few torch ops reproduce, and within a
    few 1e-5 of the float product."""
    needs_kernel()
    n, k = 24, 128
    qw = random_quantized(bits, n, k, 32)
    if scale_dtype == torch.float16:
        qw = half_factors(qw)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)) * 4
    x[0, 5] = 70.0  # an outlier in a block, as SmolLM2's residual stream has
    blocks = x.view(rows, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    x_rounded = (torch.round(blocks / d) * d).view(rows, k)
    want = torch.nn.functional.linear(x_rounded, qw.dequantize())
    got = Q.quantized_linear(x, qw)
    close_in_eps(got, want, 64, k)
    exact = torch.nn.functional.linear(x, qw.dequantize())
    assert (got - exact).abs().max() < 1e-4 * exact.abs().max()


@pytest.mark.parametrize(
    "bits,group,k,inter",
    [
        ("q4_0", 32, 576, 104),
        (4, 32, 576, 8),
        (8, 32, 576, 104),
        ("q4_0", 32, 3136, 24),
        (4, 64, 576, 104),
        (5, 32, 576, 104),
        ("q5_0", 32, 576, 8),
        (6, 256, 512, 104),
        (6, 256, 512, 8),
    ],
)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_gate_up_product_and_silu_in_one_kernel_equal_the_two_ops(bits, group, k, inter, scale_dtype):
    """quant_linear_silu_mul (a [gate | up] layer's product and silu(gate) * up in one pass, each
    task putting its gate and up panels through a scratch of its own) gives exactly
    silu_and_mul(quant_linear(x)): in every step size (decodes, the 4 x 3 tiles, several row
    blocks), on 1, 2 and 3 threads, with a bias; and a row's result is its result alone. 13 gate
    panels (104) leave tasks uneven edges; 8 is one panel of each. 721 and 800 rows: row blocks
    rounded up to AVX-512's 6-row tiles once left the last block past the rows (an empty task,
    whose negative scratch size threw in the fused form)."""
    needs_kernel()
    variant, bits = bits, ZERO_POINTS.get(bits, (bits,))[0]
    n = 2 * inter
    qw = random_quantized(bits, n, k, group)
    if scale_dtype == torch.float16:
        qw = half_factors(qw)
    qw = with_zero_point(qw, variant)
    layer = Linear(k, n, bias=True)
    layer.set_quant_method(Q.QuantMethod(bits, group, scale_dtype=scale_dtype))
    layer.load_weight(qw, "w")
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(800, k, generator=gen) * 3
    with torch.no_grad():
        layer.bias.copy_(torch.randn(n, generator=gen))
    method = layer.quant_method

    def fused(rows):
        return method.apply_silu_mul(layer, rows, layer.bias, None)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([fused(x[i : i + 1]) for i in range(x.shape[0])])
        assert alone.shape == (800, inter)
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            for rows in (1, 2, 3, 16, 65, 143, 300, 721, 800):
                got = fused(x[:rows])
                assert torch.equal(got, cpu_kernels.silu_and_mul(layer(x[:rows]))), (num_threads, rows)
                assert torch.equal(got, alone[:rows]), (num_threads, rows)
    finally:
        torch.set_num_threads(threads)
    # not a [gate | up] of whole panels, or not float32: no fused form, the caller runs the two ops
    odd = Linear(k, 24, bias=False)
    odd.set_quant_method(Q.QuantMethod(bits, group, scale_dtype=scale_dtype))
    odd.load_weight(random_quantized(bits, 24, k, group), "w")
    assert odd.quant_method.apply_silu_mul(odd, x[:2], None, None) is None
    assert method.apply_silu_mul(layer, x[:2].bfloat16(), layer.bias, None) is None


@pytest.mark.parametrize(
    "bits,group,k,n",
    [
        (4, 32, 576, 37),
        (8, 32, 576, 37),
        (4, 64, 576, 37),
        (8, None, 576, 37),
        ("q4_0", 32, 576, 37),
        ("q4_0", 32, 576, 203),
        (4, 32, 3136, 37),
        ("q4_0", 32, 3136, 37),
        (5, 32, 576, 37),
        ("q5_0", 32, 576, 203),
        (5, 32, 3136, 37),
        (6, 256, 512, 37),
        (6, 256, 512, 203),
        (6, 256, 3072, 37),
    ],
)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_a_rows_product_is_bit_identical_whatever_the_step_size_and_threads(bits, group, k, n, scale_dtype):
    """A quantized layer runs one kernel for every row count (it used to dequantize and call
    a float GEMM from 8 or 32 rows on), work split over outputs, never over a sum: a row
    alone, among 1..256 rows at any offset (so any tile edge and alignment), with 1, 2 or 3
    threads (tasks are claimed by whichever thread is free: 143 rows make 3 row blocks), gives
    the same bits. Columns not a multiple of any tile width (37) and K with a
    tail of groups (18 * 32) cover the kernel's edges; Q4_0 (its -8 folded into the integer
    sums) and a K past what AVX2 builds pre-broadcast (3136: 4 x 2 tiles that broadcast at each
    use, where K = 576 takes the 4 x 3 assembly tiles) too; 203 columns give a task several whole
    tiles for each 4 rows of a step (AVX2 runs them slice by slice of K, every 4 rows in each), and at
    K = 3136 a step of 256 rows (with AMX's bytes, 143 too) has several spans of row blocks (the tasks walk one span's
    activations under every panel block, then the next). Int6 (Q6_K: two integer sums a group, its d
    per 256 groups of 8) on the same edges."""
    needs_kernel()
    variant, bits = bits, ZERO_POINTS.get(bits, (bits,))[0]
    qw = random_quantized(bits, n, k, group)
    if scale_dtype == torch.float16:
        qw = half_factors(qw)
    qw = with_zero_point(qw, variant)  # mins = -8 (-16) x scale: dropped, folded into the kernel's sums
    layer = Linear(k, n, bias=True)
    layer.set_quant_method(Q.QuantMethod(bits, group, scale_dtype=scale_dtype))
    layer.load_weight(qw, "w")
    if variant in ZERO_POINTS:
        assert layer.quant_method.process_weights_after_loading(layer) and layer.mins is None
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(800, k, generator=gen) * 3
    with torch.no_grad():
        layer.bias.copy_(torch.randn(n, generator=gen))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
        # AVX-512 VNNI builds run rows on 16-lane tiles (two panels a vector) with 8-lane ones at the
        # edges; without them, every row on 8 lanes: the same bits.
        with mock.patch.dict(os.environ, {"PAGEDSERVE_WIDE_TILES": "0"}):
            assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(64)]), alone[:64])
            assert torch.equal(layer(x[:143]), alone[:143])
        for num_threads in (1, 2, 3):  # 3 on 2 cores: a thread descheduled mid-split, tasks claimed by the others
            torch.set_num_threads(num_threads)
            for rows in (2, 3, 4, 5, 7, 8, 9, 16, 33, 64, 65, 143, 256):
                for start in (0, 1, 6, 300 - rows):
                    got = layer(x[start : start + rows])
                    assert torch.equal(got, alone[start : start + rows]), (num_threads, rows, start)
    finally:
        torch.set_num_threads(threads)


def test_kernel_refuses_shapes_it_cannot_take():
    needs_kernel()
    qw = random_quantized(4, 8, 64, 32)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        cpu_kernels.quant_linear(torch.randn(2, 48), *Q.to_panels(qw), None, 4, 32, 8)
    with pytest.raises(RuntimeError, match="bits"):
        cpu_kernels.quant_linear(torch.randn(2, 64), *Q.to_panels(qw), None, 3, 32, 8)
    with pytest.raises(RuntimeError, match="panels do not hold"):
        cpu_kernels.quant_linear(torch.randn(2, 64), *Q.to_panels(qw), None, 4, 32, 9)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K])
def test_gguf_blocks_map_exactly_onto_quantized_weights(qtype):
    rows, cols = 6, 512
    rng = np.random.default_rng(0)
    if qtype in (T.Q4_K, T.Q5_K):  # the gguf package cannot quantize K-quants: random blocks with finite d, dmin
        block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // block_values * block_bytes), dtype=np.uint8)
        blocks = data.reshape(rows, -1, block_bytes)
        blocks[..., 0:2] = np.array([0.013], dtype=np.float16).view(np.uint8)
        blocks[..., 2:4] = np.array([0.021], dtype=np.float16).view(np.uint8)
    else:
        data = gguf_quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    want = gguf_dequantize(data, qtype).reshape(rows, cols)
    got = quantized_weight(data, qtype, rows, cols)
    assert got.bits == serving_format(qtype).bits and got.group_size == serving_format(qtype).group_size
    np.testing.assert_array_equal(got.dequantize().numpy(), want)


def test_serving_formats_of_gguf_types():
    f16, f32, F = torch.float16, torch.float32, Q.StoredFormat
    assert serving_format(T.Q4_1) == F(4, 32, f16) and serving_format(T.Q8_0) == F(8, 32, f16)
    # as stored: d and -dmin per 256, sc and mn in the groups' bytes (d * sc is exact in float32, not float16)
    assert serving_format(T.Q4_K) == F(4, 256, f16, sub_scales=True)
    assert serving_format(T.Q5_0) == F(5, 32, f16) and serving_format(T.Q5_1) == F(5, 32, f16)
    assert serving_format(T.Q5_K) == F(5, 256, f16, sub_scales=True)
    assert serving_format(T.F32) is None and serving_format(T.F16) is None
    assert serving_format(T.Q6_K) == F(6, 256, f16)  # as stored: d per 256, sc in the groups' bytes
    assert serving_format(T.Q8_K) == F(8, 32, f32)  # requantized wider
    assert serving_format(T.Q2_K) == F(2, 256, f16, sub_scales=True)  # as stored: sc | mn << 4 per 16 in the bytes
    assert serving_format(T.IQ2_XXS) == F(4, 32, f32)  # requantized


def methods(model) -> dict[str, str]:
    return {name: m.quant_method.name for name, m in model.named_modules() if isinstance(m, Linear)}


def prompt_logits(model, ids: list[int], decode: int = 3) -> torch.Tensor:
    """Logits of a prefill of ids[:-decode] (a GEMM step if long) then one decode step per token."""
    caches = model.kv_cache_spec(torch.float32).allocate(8, 16, "cpu")
    table = [[5, 1, 7, 0, 2, 6, 3, 4]]
    head = len(ids) - decode
    out = paged_forward(model, caches, [(0, 0, ids[:head])], table, 16)
    for i in range(head, len(ids)):
        out += paged_forward(model, caches, [(0, i, ids[i : i + 1])], table, 16)
    return torch.cat(out)


PROMPT = [
    5,
    9,
    200,
    17,
    33,
    4,
    88,
    120,
    7,
    7,
    61,
    250,
    3,
    19,
    44,
    100,
    150,
    201,
    12,
    13,
    14,
    15,
    16,
    17,
    18,
    30,
    31,
    32,
    33,
    34,
    35,
    36,
    37,
    38,
    39,
    40,
    41,
    60,
    61,
    62,
]


@pytest.mark.parametrize(
    "qtype,bits",
    [(T.Q4_1, 4), (T.Q4_0, 4), (T.Q8_0, 8), (T.Q5_0, 5), (T.Q5_1, 5)],
    ids=["Q4_1", "Q4_0", "Q8_0", "Q5_0", "Q5_1"],
)
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gguf_is_served_as_stored_and_equals_its_dequantized_model(tmp_path, qtype, bits, tie):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_llama(tie=tie), qtype)
    stored = load_model(str(path), dtype="float32")  # quantization="auto"
    dense = load_model(str(path), dtype="float32", quantization="none")
    assert set(methods(stored.model).values()) == {f"int{bits}"}
    assert set(methods(dense.model).values()) == {"dense"}
    layer = stored.model.model.layers[0].mlp.down_proj
    assert layer.scales.dtype == torch.float16  # the file's own fp16 factors, kept
    assert stored.weight_bytes < dense.weight_bytes / {8: 2.5, 5: 5, 4: 4}[bits]
    # Same numbers: equal up to the int16 rounding of activations (decode steps, the row
    # kernel) and summation order (the 37-token prefill, dequantize + GEMM).
    got, want = prompt_logits(stored.model, PROMPT), prompt_logits(dense.model, PROMPT)
    assert (got - want).abs().max() <= 2e-4 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1, T.Q5_K], ids=["Q5_0", "Q5_1", "Q5_K"])
def test_a_5_bit_gguf_is_served_as_its_own_bytes_in_5_5_to_6_bits_a_weight(tmp_path, qtype):
    """Q5_0 / Q5_1 / Q5_K load as int5 with no requantization: every layer's weight, read back from
    the kernel's panels, is the file's 5-bit values (the panels hold the file's nibble bytes and as
    many high bits, padding aside), and a weight costs its 5 bits plus its factors (Q5_0 5.5 bits:
    the -16 d min is made from the scale; Q5_1 6; Q5_K 5.625: its fp16 d, dmin per 256 and its sc,
    mn a byte each per 32), not int8's 9. Its logits are the dequantized model's."""
    k_quant = qtype == T.Q5_K
    model = tiny_llama(**({"hidden_size": 256, "intermediate_size": 512, "head_dim": 64} if k_quant else {}))
    path = tmp_path / "m.gguf"
    write_gguf(path, model, qtype, quantizer=random_k_blocks if k_quant else gguf_quantize)
    stored = load_model(str(path), dtype="float32")
    dense = load_model(str(path), dtype="float32", quantization="none")
    assert set(methods(stored.model).values()) == {"int5-k" if k_quant else "int5"}
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    layer = stored.model.model.layers[1].mlp.down_proj  # no row permutation: the file's row order
    n, k = layer.out_features, layer.in_features
    blocks = np.asarray(tensor.data)
    want = np.asarray(gguf_dequantize(blocks, qtype)).reshape(n, k)
    if cpu_kernels.available():
        assert layer.panelled and layer.qweight.shape == (-(-n // 8), k // 32, 176 if k_quant else 160)
        back = Q.panel_rows(5, layer.qweight, layer.scales, layer.mins, torch.arange(n), sub_scales=k_quant)
        assert torch.equal(back.qweight, quantized_weight(blocks, qtype, n, k).qweight)
        if not k_quant:  # the file's nibble bytes, reordered: the same multiset
            nibbles = blocks.reshape(n, k // 32, -1)[..., -16:].reshape(-1)
            assert sorted(layer.qweight[..., :128].flatten().tolist()) == sorted(nibbles.tolist())
        high = int((Q.unpack_int5(back.without_sub_scales().qweight, k) >> 4).sum())
        assert sum(bin(b).count("1") for b in layer.qweight[..., 128:160].flatten().tolist()) == high
        bits_a_weight = {T.Q5_0: 5.5, T.Q5_1: 6.0, T.Q5_K: 5.625}[qtype]
        held = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales, layer.mins) if t is not None)
        assert held * 8 == bits_a_weight * n * k
    assert np.array_equal(layer.quant_method.dense_weight(layer).numpy(), want)  # the file's numbers exactly
    got, want_logits = prompt_logits(stored.model, PROMPT), prompt_logits(dense.model, PROMPT)
    assert (got - want_logits).abs().max() <= 2e-4 * want_logits.abs().max()
    assert torch.equal(got.argmax(-1), want_logits.argmax(-1))


@pytest.mark.parametrize("quantization,bits", [("int8", 8), ("int4", 4)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dense_checkpoint_quantized_at_load_runs_its_rounded_weights(make_checkpoint, quantization, bits, arch):
    path, _ = make_checkpoint(arch)
    dense = load_model(str(path), dtype="float32", quantization="none")
    quant = load_model(str(path), dtype="float32", quantization=quantization)
    assert set(methods(quant.model).values()) == {f"int{bits}"}
    want, got = prompt_logits(dense.model, PROMPT), prompt_logits(quant.model, PROMPT)
    # Round to nearest moves every weight by at most half a step (tested above); this tiny
    # random model amplifies that (int4: ~40% of the logits' norm, int8: ~3%), so how close
    # the models are is not the check; that the quantized one computes exactly with its
    # rounded weights is: the dense model given those weights agrees up to summation order.
    assert (got - want).norm() / want.norm() < (0.06 if bits == 8 else 0.6)
    quant_layers = {n: m for n, m in quant.model.named_modules() if isinstance(m, Linear)}
    with torch.no_grad():
        for name, layer in dense.model.named_modules():
            if isinstance(layer, Linear):
                layer.weight.copy_(quant_layers[name].quant_method.dense_weight(quant_layers[name]))
    want = prompt_logits(dense.model, PROMPT)
    assert (got - want).abs().max() <= 2e-4 * want.abs().max()


def test_quantization_names_are_checked_before_loading(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4"):
        load_model(str(tiny_llama_dir), quantization="int3")


def test_layers_that_do_not_fit_the_format_stay_dense():
    assert Q.method_for(4, 32, 48) is Q.DENSE  # K not a multiple of 32
    assert Q.method_for(4, 64, 96) is Q.DENSE  # K not a multiple of the group
    assert Q.method_for(8, None, 96).name == "int8"
    assert Q.method_for(None, None, 96) is Q.DENSE


@pytest.mark.parametrize("quantization,bits", [("int8", 8), ("int4", 4)])
def test_deepseek_mla_and_moe_experts_get_the_method_too(tmp_path, quantization, bits):
    from tests.models.test_deepseek import _COMMON, _randomize
    from tests.models.conftest import save_checkpoint
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**_COMMON, q_lora_rank=32, n_group=4, topk_group=2, norm_topk_prob=True)
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(config).eval()
    _randomize(hf, seed=1)
    path = save_checkpoint(hf, tmp_path / "v3")
    dense = load_model(str(path), dtype="float32", quantization="none")
    quant = load_model(str(path), dtype="float32", quantization=quantization)
    got_methods = methods(quant.model)
    # hidden 64 and q_lora_rank 32 fit groups of 32; the experts' down_proj (24 inputs) stays dense.
    for name in (
        "model.layers.1.mlp.experts.gate_up.3",
        "model.layers.0.self_attn.q_b_proj",
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        "model.layers.1.mlp.shared_experts.gate_up_proj",
        "model.embed_tokens",
        "lm_head",
    ):
        assert got_methods[name] == f"int{bits}", name
    assert got_methods["model.layers.1.mlp.experts.down.3"] == "dense"
    got = prompt_logits(quant.model, PROMPT[:20], decode=4)
    quant_layers = {n: m for n, m in quant.model.named_modules() if isinstance(m, Linear)}
    with torch.no_grad():
        for name, layer in dense.model.named_modules():
            if isinstance(layer, Linear):
                layer.weight.copy_(quant_layers[name].quant_method.dense_weight(quant_layers[name]))
    want = prompt_logits(dense.model, PROMPT[:20], decode=4)
    assert (got - want).abs().max() <= 2e-4 * want.abs().max()


def test_perplexity_of_a_gguf_served_as_stored_equals_its_dequantized_model(tmp_path):
    from loadtest.perplexity import DEFAULT_TEXT, perplexity

    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_llama(tie=True), T.Q4_1)
    text = DEFAULT_TEXT.read_text()[:600]
    stored, count = perplexity(load_model(str(path), dtype="float32"), text)
    dense, same_count = perplexity(load_model(str(path), dtype="float32", quantization="none"), text)
    assert count == same_count > 100 and 1 < stored < 1e6
    assert stored == pytest.approx(dense, rel=1e-4)


def test_bench_quant_compares_like_with_like(capsys):
    """loadtest.bench_quant hands torch's int4 kernel the same weights as ours (its
    (q - 8) * s + z form with z = m + 8 s), so its timings compare the same product."""
    needs_kernel()
    from loadtest.bench_quant import main

    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))
    q = Q.quantize_int4(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(Q.unpack_int4(q.qweight, 96).int(), 1)
    scales_zeros = torch.stack((q.scales, q.mins + 8 * q.scales), -1).transpose(0, 1).contiguous().bfloat16()
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5))
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, scales_zeros).float()
    ours = torch.nn.functional.linear(x, q.dequantize())
    assert (theirs - ours).abs().max() < 0.03 * ours.abs().max()  # bf16 activations and factors
    main(["--rows", "1", "--layers", "1", "--repeats", "1"])
    assert "| 1 |" in capsys.readouterr().out


@pytest.mark.parametrize("bits,group,n", [(4, 32, 37), (4, 64, 8), (8, 32, 19), (8, None, 16), (5, 32, 37), (5, 64, 8)])
def test_panels_hold_the_stored_weight_and_give_back_any_rows(bits, group, n):
    """`to_panels` only moves 2-byte units (N padded to the panel width), and for 5 bits the high
    bits; `panel_rows` gives any rows back in the stored layout, which embedding lookups and the
    reference use."""
    qw = random_quantized(bits, n, 128, group)
    qweight, scales, mins = Q.to_panels(qw)
    panels = -(-n // Q.PANEL)
    assert qweight.shape == (panels, 4, {4: 128, 5: 160, 8: 256}[bits])
    assert scales.shape == (panels, 128 // (group or 128), 8)
    low = qweight[..., :128] if bits == 5 else qweight  # 5 bits: the nibbles as 4 bits, then the high bits
    stored = qw.qweight.view(n, 4, 20)[..., :16] if bits == 5 else qw.qweight
    assert sorted(low.flatten().tolist()) == sorted(stored.flatten().tolist() + [0] * (low.numel() - stored.numel()))
    if bits == 5:
        high = (Q.unpack_int5(qw.qweight, 128) >> 4).sum().item()
        assert sum(bin(b).count("1") for b in qweight[..., 128:].flatten().tolist()) == high
    rows = torch.tensor([n - 1, 0, 3 % n, n - 1])
    back = Q.panel_rows(bits, qweight, scales, mins, rows)
    assert torch.equal(back.qweight, qw.qweight[rows]) and torch.equal(back.scales, qw.scales[rows])
    assert (back.mins is None) == (qw.mins is None) and (mins is None or torch.equal(back.mins, qw.mins[rows]))
    assert torch.equal(back.dequantize(), qw.dequantize()[rows])


def test_a_layer_in_panels_looks_up_and_multiplies_as_stored():
    """The loader reorders quantized layers once (`process_weights_after_loading`); lookups
    (a tied embedding) and the float reference read the panels back."""
    needs_kernel()
    qw = random_quantized(4, 21, 64, 32)
    layer = Linear(64, 21)
    layer.set_quant_method(Q.QuantMethod(4, 32))
    layer.load_weight(qw, "w")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    before = layer.quant_method.dense_weight(layer)
    assert layer.quant_method.process_weights_after_loading(layer) and layer.qweight.dim() == 3
    assert torch.equal(layer.quant_method.dense_weight(layer), before)
    ids = torch.tensor([[20, 0], [7, 7]])
    assert torch.equal(layer.quant_method.embedding(layer, ids), before[ids])
    close_in_eps(layer(x), torch.nn.functional.linear(x, before), 64, 64)
    with pytest.raises(RuntimeError, match="already reordered"):
        layer.load_weight(qw, "w")


@pytest.mark.parametrize("variant", ["q4_0", "q5_0"])
def test_q4_0_mins_are_made_from_the_scales_with_the_same_bits(variant):
    """GGUF's Q4_0 (w = d (q - 8)) arrives with mins = -8 d: the layer drops them (a sixth fewer
    bytes a weight) and the kernel makes them from the scales: the same weights exactly, and the
    same product to float32 rounding (the kernel folds -8 into the integer sum, so it rounds once
    fewer than with mins as stored); other mins stay. Q5_0's -16 likewise."""
    needs_kernel()
    bits = ZERO_POINTS[variant][0]
    q4_1 = half_factors(random_quantized(bits, 21, 128, 32))
    q4_0 = with_zero_point(q4_1, variant)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    for qw, dropped in ((q4_0, True), (q4_1, False)):
        layer = Linear(128, 21)
        layer.set_quant_method(Q.QuantMethod(bits, 32, scale_dtype=torch.float16))
        layer.load_weight(qw, "w")
        assert layer.quant_method.process_weights_after_loading(layer)
        assert (layer.mins is None) == dropped
        stored = Q.quantized_linear(x, qw)  # with the mins as stored
        if dropped:
            eps = torch.finfo(torch.float32).eps
            torch.testing.assert_close(layer(x), stored, rtol=0, atol=16 * eps * stored.abs().max().item())
        else:
            assert torch.equal(layer(x), stored)
        assert torch.equal(layer.quant_method.dense_weight(layer), qw.dequantize())
    with pytest.raises(RuntimeError, match="power of two"):
        cpu_kernels.quant_linear(x, *Q.to_panels(q4_0)[:2], None, None, bits, 32, 21, -7.0)
