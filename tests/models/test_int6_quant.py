"""GGUF Q6_K and Q3_K served as stored (int6): their blocks against gguf-py, the kernel's products against the
dequantized float reference, and tiny and real files loaded without requantization.

Row invariance (a row's bits whatever its step and thread count) and the fused gate/up product
are test_quantization's tests, which take int6 among their types.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from models.gguf import quantized_weight, serving_format
from models.layers import cpu_kernels
from models.layers import quantization as Q
from models.layers.linear import Linear
from models.loader import load_model
from tests.models.test_gguf import tiny_llama, write_gguf
from tests.models.test_quantization import PROMPT, close_in_eps, methods, needs_kernel, prompt_logits

T = GGMLQuantizationType


def q6_k_blocks(array: np.ndarray, qtype: GGMLQuantizationType = T.Q6_K) -> np.ndarray:
    """Q6_K blocks of a 2-D float array, rounded to nearest (the gguf package cannot quantize
    K-quants): per 16 values a step to +-31, an fp16 d per 256 with int8 sub-scales, then
    llama.cpp's packing: each 128 values' low nibbles in 64 bytes (values j and 64 + j in byte j),
    their bits 4-5 in 32 (value 32 r + j at bits 2r, 2r + 1 of byte j)."""
    assert qtype == T.Q6_K
    rows, cols = array.shape
    w = array.astype(np.float32).reshape(rows, cols // 256, 16, 16)
    step = np.abs(w).max(-1) / 31  # (rows, blocks, 16)
    d = (step.max(-1) / 127).astype(np.float16)  # (rows, blocks)
    safe = np.maximum(d.astype(np.float32), np.finfo(np.float16).tiny)[..., None]
    sc = np.clip(np.round(step / safe), -128, 127)
    exact = np.maximum(np.abs(d.astype(np.float32)[..., None] * sc), np.finfo(np.float32).tiny)[..., None]
    q = (np.clip(np.round(w / exact), -32, 31) + 32).astype(np.uint8).reshape(rows, cols // 256, 2, 128)
    ql = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)  # (rows, blocks, 2, 64)
    high = (q >> 4).reshape(rows, cols // 256, 2, 4, 32)
    qh = high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6  # (.., 2, 32)
    blocks = np.concatenate(
        (
            ql.reshape(rows, cols // 256, 128),
            qh.reshape(rows, cols // 256, 64),
            sc.astype(np.int8).view(np.uint8),
            d[..., None].view(np.uint8),
        ),
        axis=-1,
    )
    return blocks.reshape(rows, -1)


def random_q6_k_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K blocks: every value and sub-scale, -128 and -32 included, and a finite d."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., 208:210] = rng.uniform(1e-3, 3e-2, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def q3_k_blocks(array: np.ndarray, qtype: GGMLQuantizationType = T.Q3_K) -> np.ndarray:
    """Q3_K blocks of a 2-D float array, rounded to nearest (the gguf package cannot quantize
    K-quants): per 16 values a step to -4..3, an fp16 d per 256 with 6-bit sub-scales (stored + 32),
    then llama.cpp's packing (block_q3_K): hmask (bit b of byte j: value 32 b + j's bit 2), qs (value
    128 c + 32 s + j's low 2 bits at bits 2 s of byte 32 c + j), the scales' low nibbles (scale k:
    byte k % 8, nibble k // 8) and high 2 bits (byte 8 + k % 4, bits 2 (k // 4)), d."""
    assert qtype == T.Q3_K
    rows, cols = array.shape
    nb = cols // 256
    w = array.astype(np.float32).reshape(rows, nb, 16, 16)
    # as llama.cpp: the step's sign puts each sub-block's largest |w| on -4, the one end with no twin
    largest = np.take_along_axis(w, np.abs(w).argmax(-1)[..., None], -1)[..., 0]
    step = -largest / 4  # (rows, blocks, 16)
    d = (np.abs(step).max(-1) / 31).astype(np.float16)  # (rows, blocks)
    safe = np.maximum(d.astype(np.float32), np.finfo(np.float16).tiny)[..., None]
    sc = np.clip(np.round(step / safe), -32, 31)
    exact = d.astype(np.float32)[..., None] * sc
    exact = np.where(exact == 0, np.float32(1), exact)[..., None]
    q = (np.clip(np.round(w / exact), -4, 3) + 4).astype(np.uint8).reshape(rows, nb, 256)
    hmask = ((q >> 2).reshape(rows, nb, 8, 32) << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(-2, dtype=np.uint8)
    low = (q & 3).reshape(rows, nb, 2, 4, 32) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    qs = low.sum(-2, dtype=np.uint8).reshape(rows, nb, 64)
    s6 = (sc + 32).astype(np.uint8)  # (rows, blocks, 16)
    nibbles = (s6[..., :8] & 0x0F) | ((s6[..., 8:] & 0x0F) << 4)
    tops = ((s6 >> 4).reshape(rows, nb, 4, 4) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)).sum(
        -2, dtype=np.uint8
    )
    blocks = np.concatenate((hmask, qs, nibbles, tops, d[..., None].view(np.uint8)), axis=-1)
    return blocks.reshape(rows, -1)


def random_q3_k_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q3_K blocks: every 3-bit value and 6-bit scale (-32 and 31 included), a finite d, and
    d's extremes: fp16's largest (65504, so |d sc q| = 2^23-ish, still exact in float32) and
    smallest subnormal."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 110), dtype=np.uint8)
    d = rng.uniform(1e-3, 3e-2, (rows, cols // 256, 1)).astype(np.float16)
    d[0, 0], d[-1, -1] = np.float16(65504), np.float16(2**-24)
    blocks[..., 108:110] = d.view(np.uint8)
    blocks[0, -1, 96:108] = [0x00] * 8 + [0x00] * 4  # every scale -32
    blocks[-1, 0, 96:108] = [0xFF] * 8 + [0xFF] * 4  # every scale 31
    return blocks.reshape(rows, -1)


def test_q3_k_blocks_map_exactly_onto_int6():
    """Q3_K's w = d (sc - 32) q3 is int6's w = d sc (q - 32) with q = q3 + 32: every weight is
    gguf-py's dequantized value bit for bit, extreme scales and d included, from 26 bytes a group of
    32 and the file's fp16 d per 256 (6.5625 bits a weight against the file's 3.4375)."""
    rows, cols = 7, 1024
    data = random_q3_k_blocks(rows, cols)
    got = quantized_weight(data, T.Q3_K, rows, cols)
    assert serving_format(T.Q3_K) == serving_format(T.Q6_K) == Q.StoredFormat(6, 256, torch.float16)
    assert got.bits == 6 and got.group_size == 256 and got.scales.dtype == torch.float16 and got.mins is None
    want = gguf_dequantize(data, T.Q3_K).reshape(rows, cols)
    np.testing.assert_array_equal(got.dequantize().numpy(), want)
    assert np.abs(want).max() > 2**22 and 0 < np.abs(want[want != 0]).min() < 2**-20  # the extremes were there
    q, sc = Q.unpack_int6(got.qweight, cols)
    assert 28 <= int(q.min()) and int(q.max()) <= 35 and int(sc.min()) == -32 and int(sc.max()) == 31
    assert torch.equal(
        got.scales.view(torch.int16),
        torch.from_numpy(data.reshape(rows, -1, 110)[..., 108:].copy()).view(torch.int16)[..., 0],
    )
    assert (got.qweight.numel() + got.scales.numel() * 2) * 110 == data.nbytes * 210
    # our test quantizer writes blocks gguf-py reads back near the weights
    w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    back = gguf_dequantize(q3_k_blocks(w), T.Q3_K).reshape(rows, cols)
    assert np.sqrt(np.mean((back - w) ** 2)) < 0.2  # 8 levels a sub-block: ~0.1 of w's spread


def test_q6_k_blocks_map_exactly_onto_int6_in_the_files_bytes():
    """Every weight is gguf-py's dequantized value bit for bit (d * sc exact in float32, then
    times q - 32 exactly), from 26 bytes a group of 32 and an fp16 d per 256: 210 bytes a block,
    Q6_K's own size."""
    rows, cols = 7, 768
    data = random_q6_k_blocks(rows, cols)
    got = quantized_weight(data, T.Q6_K, rows, cols)
    assert serving_format(T.Q6_K) == Q.StoredFormat(6, 256, torch.float16)
    assert got.bits == 6 and got.group_size == 256 and got.scales.dtype == torch.float16 and got.mins is None
    np.testing.assert_array_equal(got.dequantize().numpy(), gguf_dequantize(data, T.Q6_K).reshape(rows, cols))
    assert got.qweight.numel() + got.scales.numel() * 2 == data.nbytes
    # our test quantizer writes blocks gguf-py reads back near the weights
    w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    back = gguf_dequantize(q6_k_blocks(w), T.Q6_K).reshape(rows, cols)
    assert np.abs(back - w).max() < 0.05 * np.abs(w).max()


@pytest.mark.parametrize("n", [37, 8])
def test_int6_panels_hold_the_stored_weight_and_give_back_any_rows(n):
    qw = quantized_weight(random_q6_k_blocks(n, 512, seed=n), T.Q6_K, n, 512)
    qweight, scales, mins = Q.to_panels(qw)
    panels = -(-n // Q.PANEL)
    assert qweight.shape == (panels, 16, 208) and scales.shape == (panels, 2, 8) and mins is None
    stored = qw.qweight.view(n, 16, 26)
    low = qweight[..., :128]  # the nibble bytes, reordered by 2-byte units
    assert sorted(low.flatten().tolist()) == sorted(stored[..., :16].flatten().tolist() + [0] * (low.numel() - n * 256))
    high = (Q.unpack_int6(qw.qweight, 512)[0] >> 4).to(torch.int64)
    ones = int((high & 1).sum() + (high >> 1).sum())
    assert sum(bin(b).count("1") for b in qweight[..., 128:192].flatten().tolist()) == ones
    sub = qweight[..., 192:].reshape(panels, 16, 2, 8).permute(0, 3, 1, 2).reshape(-1, 32)[:n]
    assert torch.equal(sub, stored[..., 24:].reshape(n, 32))
    rows = torch.tensor([n - 1, 0, 3 % n, n - 1])
    back = Q.panel_rows(6, qweight, scales, mins, rows)
    assert torch.equal(back.qweight, qw.qweight[rows]) and torch.equal(back.scales, qw.scales[rows])
    assert torch.equal(back.dequantize(), qw.dequantize()[rows])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 9])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_int6_product_is_the_dequantized_weight_times_the_rounded_activations(rows, scale_dtype):
    """The kernel's 6-bit product (two integer sums a group, one per sub-scale) is the dequantized
    weight times x rounded to int16 per 32 values, to float32 rounding, and within 1e-4 of the float
    product; extreme values (q = 0, i.e. -32, and sc = -128) included by the random blocks."""
    needs_kernel()
    n, k = 45, 768
    qw = quantized_weight(random_q6_k_blocks(n, k, seed=rows), T.Q6_K, n, k)
    qw = Q.QuantizedWeight(6, qw.qweight, qw.scales.to(scale_dtype), None, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)) * 4
    x[0, 5] = 70.0
    blocks = x.view(rows, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    x_rounded = (torch.round(blocks / d) * d).view(rows, k)
    got = Q.quantized_linear(x, qw)
    close_in_eps(got, torch.nn.functional.linear(x_rounded, qw.dequantize()), 64, k)
    exact = torch.nn.functional.linear(x, qw.dequantize())
    assert (got - exact).abs().max() < 1e-4 * exact.abs().max()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    assert torch.equal(Q.quantized_linear(x, qw, bias), torch.add(got, bias))


@pytest.mark.parametrize("spread", [3.0, 0.01], ids=["normal-d", "subnormal-d"])
def test_a_dense_weight_rounds_to_int6_within_half_a_step(spread):
    """Also where d falls below fp16's smallest normal, as a trained layer's (|w| ~ 0.01) does: the
    sub-scales are taken against d as stored (a dense MoE expert of a Q6_K or Q3_K file comes here)."""
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(1)) * spread
    qw = Q.quantize_int6(w)
    _, sc = Q.unpack_int6(qw.qweight, 512)
    step = (qw.scales.float().repeat_interleave(16, dim=1) * sc.float()).abs().repeat_interleave(16, dim=1)
    assert ((qw.dequantize() - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    layer = Linear(512, 16)
    layer.set_quant_method(Q.method_for(6, None, 512, torch.float16))
    layer.load_weight(w, "w")  # a dense weight into an int6 layer: rounded the same way
    assert torch.equal(layer.quant_method.dense_weight(layer), qw.dequantize())


@pytest.mark.parametrize(
    "qtype, tie",
    [(T.Q6_K, True), (T.Q6_K, False), (T.Q3_K, False)],
    ids=["q6_k-tied", "q6_k-untied", "q3_k"],
)
def test_a_q6_k_or_q3_k_gguf_is_served_as_int6_holding_the_files_values(tmp_path, qtype, tie):
    """A Q6_K or Q3_K file loads as int6 with no requantization (Q3_K was int4, rounded from the
    dequantized weights): every layer's weight read back from the kernel's panels is the file's
    blocks' values, a weight costs 6.5625 bits (Q6_K's own size, not int8's 9; Q3_K's 3.4375 in
    its 6-bit form), a tied embedding looks its rows up from the same panels, and the logits are
    the dequantized model's."""
    model = tiny_llama(tie=tie, hidden_size=256, intermediate_size=512, head_dim=64)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, qtype, quantizer=q6_k_blocks if qtype == T.Q6_K else q3_k_blocks)
    stored = load_model(str(path), dtype="float32")
    dense = load_model(str(path), dtype="float32", quantization="none")
    assert set(methods(stored.model).values()) == {"int6"}
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    layer = stored.model.model.layers[1].mlp.down_proj
    n, k = layer.out_features, layer.in_features
    blocks = np.asarray(tensor.data)
    if cpu_kernels.available():
        assert layer.panelled and layer.qweight.shape == (-(-n // 8), k // 32, 208)
        assert getattr(layer, "mins", None) is None
        back = Q.panel_rows(6, layer.qweight, layer.scales, None, torch.arange(n))
        assert torch.equal(back.qweight, quantized_weight(blocks, qtype, n, k).qweight)
        held = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales))
        # 210 bytes per 256 weights (n is a multiple of 8: no padding); the file's block is 210 or 110.
        assert held * GGML_QUANT_SIZES[qtype][1] == blocks.nbytes * 210
    want = np.asarray(gguf_dequantize(blocks, qtype)).reshape(n, k)
    assert np.array_equal(layer.quant_method.dense_weight(layer).numpy(), want)
    got, want_logits = prompt_logits(stored.model, PROMPT), prompt_logits(dense.model, PROMPT)
    assert (got - want_logits).abs().max() <= 2e-4 * want_logits.abs().max()
    assert torch.equal(got.argmax(-1), want_logits.argmax(-1))


def test_a_merged_layer_of_q6_k_and_other_types_is_int8_as_before():
    from models.loader import choose_methods

    formats = {"a.q_proj.weight": serving_format(T.Q4_K), "a.v_proj.weight": serving_format(T.Q6_K)}
    choose = choose_methods("auto", formats.get)
    assert choose(["a.q_proj.weight", "a.v_proj.weight"], 512).name == "int8"
    assert choose(["a.v_proj.weight"], 512).name == "int6"
    assert choose(["a.v_proj.weight"], 512 + 32).name == "dense"  # K not a multiple of 256
    formats["a.k_proj.weight"] = serving_format(T.Q3_K)  # Q3_K beside Q6_K: both int6, exactly
    assert choose(["a.k_proj.weight", "a.v_proj.weight"], 512).name == "int6"
