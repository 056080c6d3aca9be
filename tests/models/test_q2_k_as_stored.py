"""Q2_K served in its own form (2 bits with sub-scales: each group of 32 its 8 bytes of 2-bit values, then
its two scale bytes sc | mn << 4 as stored; the layer's scales and mins the fp16 d and -dmin per 256): the
file's 2.625 bits a weight and its numbers bit for bit, and kernel outputs within a few ulps of the
dequantized weight times the int16-rounded activations, each row's bits its own whatever the row count,
thread count, wide tiles on or off, and the fused silu, on this process's build and (slow) the others."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from models.gguf import quantized_weight, serving_format
from models.layers import cpu_isa, cpu_kernels
from models.layers import quantization as Q
from models.layers.linear import Linear
from models.loader import choose_methods, load_model
from tests.models.test_gguf import tiny_llama, write_gguf
from tests.models.test_quantization import PROMPT, close_in_eps, methods, needs_kernel, prompt_logits

T = GGMLQuantizationType
REPO = Path(__file__).resolve().parents[2]
FP16_EXTREMES = np.array([65504.0, 6e-8, 6.1e-5, 1e-4, 0.013, 0.0], dtype=np.float16)  # max, subnormals, 0
BITS_A_WEIGHT = 2.625  # 2 bits, a scale byte per 16, fp16 d and dmin per 256: the file's own


def q2k_blocks(array: np.ndarray, qtype: GGMLQuantizationType = T.Q2_K, seed: int = 0) -> np.ndarray:
    """Random Q2_K blocks for a tensor of `array`'s shape: random values and scale bytes, d and dmin small
    enough for a model's weights ([16 scale bytes | 64 of values | d f16 | dmin f16])."""
    rows, cols = array.shape
    rng = np.random.default_rng(seed + rows * cols)
    blocks = rng.integers(0, 256, (rows, cols // 256, GGML_QUANT_SIZES[T.Q2_K][1]), dtype=np.uint8)
    blocks[..., 80:82] = rng.uniform(1e-4, 3e-4, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    blocks[..., 82:84] = rng.uniform(1e-4, 3e-4, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def extreme_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """q2k_blocks with fp16's largest, subnormal and zero d and dmin, and every sub-scale and sub-min 0 or 15
    in some blocks."""
    blocks = q2k_blocks(np.zeros((rows, cols)), seed=seed).reshape(rows, cols // 256, -1)
    rng = np.random.default_rng(seed)
    for at in (80, 82):
        blocks[..., at : at + 2] = rng.choice(FP16_EXTREMES, blocks.shape[:2])[..., None].view(np.uint8)
    blocks[0, 0, :16] = 0xFF
    blocks[-1, -1, :16] = 0
    return blocks.reshape(rows, -1)


def test_blocks_map_exactly_onto_two_bits_with_sub_scales():
    rows, cols = 7, 1024
    data = extreme_blocks(rows, cols)
    want = gguf_dequantize(data, T.Q2_K).reshape(rows, cols)
    got = quantized_weight(data, T.Q2_K, rows, cols)
    assert got.bits == 2 and got.sub_scales and got.group_size == 256
    assert got.qweight.shape == (rows, cols // 32 * 10)
    assert got.scales.dtype == got.mins.dtype == torch.float16
    assert np.array_equal(got.dequantize().numpy(), want, equal_nan=True)  # bit for bit, infinities too
    # every scale byte as stored, in the order of its sub-blocks
    stored = got.qweight.view(rows, cols // 32, 10)[..., 8:].reshape(rows, -1)
    assert np.array_equal(stored.numpy(), data.reshape(rows, -1, 84)[..., :16].reshape(rows, -1))
    assert serving_format(T.Q2_K) == Q.StoredFormat(2, 256, torch.float16, sub_scales=True)


@pytest.mark.parametrize("n", [37, 8])
def test_panels_hold_the_stored_weight_and_give_back_any_rows(n):
    qw = quantized_weight(q2k_blocks(np.zeros((n, 768)), seed=n), T.Q2_K, n, 768)
    qweight, scales, mins = Q.to_panels(qw)
    assert qweight.shape == (-(-n // 8), 24, 80) and scales.shape == mins.shape == (-(-n // 8), 3, 8)
    for rows in (torch.arange(n), torch.tensor([n - 1, 0, 3, 3])):
        back = Q.panel_rows(2, qweight, scales, mins, rows, sub_scales=True)
        want = qw.rows(rows)
        assert back.sub_scales and torch.equal(back.qweight, want.qweight)
        assert torch.equal(back.scales, want.scales) and torch.equal(back.mins, want.mins)


def test_tensor_parallel_columns_keep_whole_super_blocks_or_fall_back_to_int8():
    qw = quantized_weight(q2k_blocks(np.zeros((6, 1024))), T.Q2_K, 6, 1024)
    dense = qw.dequantize()
    half = qw.columns(slice(512, 1024), "w")
    assert half.sub_scales and torch.equal(half.dequantize(), dense[:, 512:])
    cut = qw.columns(slice(0, 352), "w")  # 352 = 11 groups of 32: super-block 2 is cut
    assert cut.bits == 8 and cut.group_size == 32
    assert (cut.dequantize() - dense[:, :352]).abs().max() <= dense.abs().max() / 127


def test_merged_layers_keep_the_form_alone_and_take_int8_beside_other_types():
    formats = {"a.q.weight": serving_format(T.Q2_K), "a.k.weight": serving_format(T.Q2_K)}
    formats |= {f"a.{t.name}.weight": serving_format(t) for t in (T.Q4_0, T.Q4_K, T.Q6_K)}
    choose = choose_methods("auto", formats.get)
    alone = choose(["a.q.weight", "a.k.weight"], 512)
    assert alone.name == "int2-k" and alone.group_size == 256 and alone.scale_dtype == torch.float16
    for other in (T.Q4_0, T.Q4_K, T.Q6_K):  # Q2_K's mins per 16 fit no group of 32: requantized to int8
        assert choose(["a.q.weight", f"a.{other.name}.weight"], 512).name == "int8", other
    assert choose(["a.q.weight"], 4480).name == "int8"  # a tensor-parallel share of 17.5 super-blocks
    qw = quantized_weight(q2k_blocks(np.zeros((16, 512))), T.Q2_K, 16, 512)
    layer = Linear(512, 16, bias=False)
    layer.set_quant_method(alone)
    layer.load_weight(qw, "w")
    assert torch.equal(alone.dense_weight(layer), qw.dequantize())
    beside = Linear(512, 16, bias=False)
    beside.set_quant_method(choose(["a.q.weight", "a.Q4_0.weight"], 512))
    beside.load_weight(qw, "w")
    want = qw.dequantize()
    assert (beside.quant_method.dense_weight(beside) - want).abs().max() <= want.abs().max() / 127


def _layer(qw: Q.QuantizedWeight, n: int, k: int) -> Linear:
    layer = Linear(k, n, bias=True)
    layer.set_quant_method(Q.QuantMethod(2, 256, scale_dtype=torch.float16, sub_scales=True))
    layer.load_weight(qw, "w")
    with torch.no_grad():
        layer.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(n)))
    return layer


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int16 per 32 values as the kernel rounds it, back in float."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    return (torch.round(blocks / torch.where(d > 0, d, 1.0)) * d).view(x.shape)


# The check, in this process for the build loaded here and in a subprocess for the others (PAGEDSERVE_CPU_ISA).
CHECK = """
import os, sys, torch
sys.path.insert(0, os.getcwd())
from tests.models.test_q2_k_as_stored import product_failures
from models.layers import cpu_kernels
failures = product_failures()
print("BUILD", cpu_kernels.loaded_target())  # loaded by the first product
print("FAILURES", failures)
"""


def product_failures() -> list:
    """Cases where a product is not within a few ulps of the dequantized weight times the rounded x, or a
    row's result differs in any bit from that row alone: rows 1..70 (decodes, `tile`'s 4-row tiles, AVX-512's
    6 x 3 and 8 x 2 wide tiles in one pass or two, and their edges), 1-3 threads, wide tiles on and off (the
    rows alone on the 8-lane tiles), and the fused silu."""
    failures = []
    threads = torch.get_num_threads()
    try:
        for n, k in ((37, 768), (208, 512), (16, 2304)):
            qw = quantized_weight(q2k_blocks(np.zeros((n, k)), seed=k), T.Q2_K, n, k)
            layer = _layer(qw, n, k)
            x = torch.randn(70, k, generator=torch.Generator().manual_seed(k)) * 3
            x[0, 5] = 70.0
            want = torch.nn.functional.linear(_rounded(x), qw.dequantize(), layer.bias)
            torch.set_num_threads(1)
            with mock.patch.dict(os.environ, {"PAGEDSERVE_WIDE_TILES": "0"}):
                alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
            try:
                close_in_eps(alone, want, 64, k)
            except AssertionError as e:
                failures.append(("reference", n, k, str(e)))
            for wide in ("1", "0"):
                with mock.patch.dict(os.environ, {"PAGEDSERVE_WIDE_TILES": wide}):
                    for num_threads in (1, 2, 3):
                        torch.set_num_threads(num_threads)
                        for rows in range(1, 71):
                            start = (7 * rows) % (71 - rows)
                            if not torch.equal(layer(x[start : start + rows]), alone[start : start + rows]):
                                failures.append(("alone", n, k, wide, num_threads, rows))
                            if n % 16 == 0 and rows in (1, 2, 3, 8, 9, 33, 70):
                                fused = layer.quant_method.apply_silu_mul(layer, x[:rows], layer.bias, None)
                                gate, up = alone[:rows].chunk(2, dim=-1)
                                if fused is None or not torch.equal(fused, cpu_kernels.silu_and_mul(alone[:rows])):
                                    failures.append(("silu", n, k, wide, num_threads, rows))
                                close = (fused - torch.nn.functional.silu(gate) * up).abs().max()
                                if close > 1e-5 * (gate.abs().max() * up.abs().max()):
                                    failures.append(("silu-ref", n, k, wide, num_threads, rows))
    finally:
        torch.set_num_threads(threads)
    return failures


def test_product_is_close_to_the_dequantized_reference_and_row_invariant():
    needs_kernel()
    assert product_failures() == []


@pytest.mark.slow
@pytest.mark.parametrize("target", ["avx2", "generic"])
def test_product_on_the_other_builds(target):
    """AVX2 and the plain C++ build run `tile` alone (builds the target where it is not built yet: minutes)."""
    if target not in {t.name for t in cpu_isa.supported(cpu_isa.read_cpu_flags())}:
        pytest.skip(f"this CPU does not run the {target} build")
    env = {**os.environ, "PAGEDSERVE_CPU_ISA": target}
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"BUILD {target}" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "FAILURES []" in out.stdout, out.stdout


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_gguf_is_served_as_stored_with_the_logits_of_its_dequantized_weights(tmp_path, tie):
    """Every layer (the tied embedding and head too) keeps the file's d, dmin, scale bytes and values:
    2.625 bits a weight where the int4 requantization took 6, the file's numbers exactly, and the logits
    those of the dense dequantized model."""
    model = tiny_llama(tie=tie, hidden_size=256, intermediate_size=512, head_dim=64)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, T.Q2_K, quantizer=q2k_blocks)
    stored = load_model(str(path), dtype="float32")
    dense = load_model(str(path), dtype="float32", quantization="none")
    assert set(methods(stored.model).values()) == {"int2-k"}
    down = stored.model.model.layers[1].mlp.down_proj
    blocks = {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}["blk.1.ffn_down.weight"]
    want = gguf_dequantize(blocks, T.Q2_K).reshape(down.out_features, down.in_features)
    assert np.array_equal(down.quant_method.dense_weight(down).numpy(), want)
    held = sum(t.numel() * t.element_size() for t in (down.qweight, down.scales, down.mins))
    assert held == blocks.nbytes and held * 8 == BITS_A_WEIGHT * want.size  # the file's bytes, no more
    if cpu_kernels.available():
        assert down.panelled and down.qweight.shape == (down.out_features // 8, down.in_features // 32, 80)
    got, want_logits = prompt_logits(stored.model, PROMPT), prompt_logits(dense.model, PROMPT)
    assert (got - want_logits).abs().max() <= 2e-4 * want_logits.abs().max()
    assert torch.equal(got.argmax(-1), want_logits.argmax(-1))
