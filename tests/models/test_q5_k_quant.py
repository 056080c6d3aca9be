"""Q5_K served in its own form (5 bits with sub-scales: each group of 32 its int5 bytes, then its 6-bit sc and
mn as uint8; the layer's scales and mins the fp16 d and -dmin per 256), as Q4_K is (test_q4_k_quant.py): the
file's numbers bit for bit, and kernel outputs bit-identical to the same weight with d * sc and -dmin * mn
multiplied out into float32 factors (5-bit groups of 32), on every tile family that runs 5 bits (AVX-512
VNNI's wide tiles and `tile` on the AVX-512, AVX2 and plain C++ builds), row count and thread count."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from models import gguf as G
from models.gguf import quantized_weight, serving_format
from models.layers import cpu_isa, cpu_kernels
from models.layers import quantization as Q
from models.layers.linear import Linear
from models.loader import choose_methods, load_model
from tests.models.test_gguf import random_k_blocks, tiny_llama, write_gguf
from tests.models.test_q4_k_quant import FP16_EXTREMES, REPO
from tests.models.test_quantization import PROMPT, methods, needs_kernel, prompt_logits

T = GGMLQuantizationType


def q5_k_blocks(rows: int, cols: int, seed: int = 0, extreme: bool = False) -> np.ndarray:
    """Random Q5_K blocks: a model's small d and dmin, or (`extreme`) fp16's largest, subnormal and zero ones
    with sc and mn all 0 or all 63 in some blocks."""
    blocks = random_k_blocks(np.zeros((rows, cols), dtype=np.float32), T.Q5_K, seed).reshape(rows, cols // 256, -1)
    if extreme:
        rng = np.random.default_rng(seed)
        for at in (0, 2):  # d, dmin
            blocks[..., at : at + 2] = rng.choice(FP16_EXTREMES, blocks.shape[:2])[..., None].view(np.uint8)
        blocks[0, 0, 4:16] = 0xFF  # every sc and mn 63
        blocks[-1, -1, 4:16] = 0  # every sc and mn 0
    return blocks.reshape(rows, -1)


def test_q5_k_blocks_map_exactly_onto_5_bits_with_sub_scales():
    rows, cols = 7, 1024
    data = q5_k_blocks(rows, cols, extreme=True)
    want = gguf_dequantize(data, T.Q5_K).reshape(rows, cols)
    got = quantized_weight(data, T.Q5_K, rows, cols)
    assert got.bits == 5 and got.sub_scales and got.group_size == 256
    assert got.qweight.shape == (rows, cols // 32 * 22) and got.scales.dtype == got.mins.dtype == torch.float16
    assert np.array_equal(got.dequantize().numpy(), want, equal_nan=True)  # bit for bit, infinities too
    plain = got.without_sub_scales()  # the form a Q5_K part takes beside other types
    assert plain.group_size == 32 and plain.scales.dtype == torch.float32
    assert np.array_equal(plain.dequantize().numpy(), want, equal_nan=True)
    assert serving_format(T.Q5_K) == Q.StoredFormat(5, 256, torch.float16, sub_scales=True)


@pytest.mark.parametrize("n", [37, 8])
def test_q5_k_panels_hold_the_stored_weight_and_give_back_any_rows(n):
    qw = quantized_weight(q5_k_blocks(n, 768, seed=n), T.Q5_K, n, 768)
    qweight, scales, mins = Q.to_panels(qw)
    assert qweight.shape == (-(-n // 8), 24, 176) and scales.shape == mins.shape == (-(-n // 8), 3, 8)
    for rows in (torch.arange(n), torch.tensor([n - 1, 0, 3, 3])):
        back = Q.panel_rows(5, qweight, scales, mins, rows, sub_scales=True)
        want = qw.rows(rows)
        assert back.sub_scales and torch.equal(back.qweight, want.qweight)
        assert torch.equal(back.scales, want.scales) and torch.equal(back.mins, want.mins)


def test_q5_k_tensor_parallel_columns_keep_whole_super_blocks_or_fall_back_to_groups_of_32():
    qw = quantized_weight(q5_k_blocks(6, 1024), T.Q5_K, 6, 1024)
    dense = qw.dequantize()
    half = qw.columns(slice(512, 1024), "w")
    assert half.sub_scales and torch.equal(half.dequantize(), dense[:, 512:])
    cut = qw.columns(slice(0, 352), "w")  # 352 = 11 groups of 32: super-block 2 is cut
    assert not cut.sub_scales and torch.equal(cut.dequantize(), dense[:, :352])


def test_merged_layers_keep_q5_k_as_stored_alone_and_exact_beside_other_types():
    parts = [("q", T.Q5_K), ("k", T.Q5_K), ("v", T.Q6_K), ("o", T.Q5_0), ("p", T.Q4_K), ("r", T.Q4_0)]
    formats = {f"a.{p}.weight": serving_format(t) for p, t in parts}
    choose = choose_methods("auto", formats.get)
    alone = choose(["a.q.weight", "a.k.weight"], 512)
    assert alone.name == "int5-k" and alone.group_size == 256 and alone.scale_dtype == torch.float16
    assert choose(["a.q.weight", "a.v.weight"], 512).name == "int8"  # as before: int6 is Q6_K's alone
    beside = [choose(["a.q.weight", "a." + p + ".weight"], 512) for p in "opr"]  # Q5_0, Q4_K, Q4_0
    for method in beside:  # float32 factors: d * sc is no fp16
        assert method.name == "int5" and method.group_size == 32 and method.scale_dtype == torch.float32
    share = choose(["a.q.weight"], 4480)  # a tensor-parallel share of 17.5 super-blocks: groups of 32
    assert share.name == "int5" and share.group_size == 32
    # each loads the file's numbers exactly
    qw = quantized_weight(q5_k_blocks(16, 512), T.Q5_K, 16, 512)
    for method in (alone, *beside):
        layer = Linear(512, 16, bias=False)
        layer.set_quant_method(method)
        layer.load_weight(qw, "w")
        assert torch.equal(method.dense_weight(layer), qw.dequantize()), method.name


def _layers(qw: Q.QuantizedWeight, n: int, k: int) -> tuple[Linear, Linear]:
    """(qw as stored, qw with its factors multiplied out into float32 int5), both with a bias."""
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    layers = []
    for method, weight in (
        (Q.QuantMethod(5, 256, scale_dtype=torch.float16, sub_scales=True), qw),
        (Q.QuantMethod(5, 32), qw.without_sub_scales()),
    ):
        layer = Linear(k, n, bias=True)
        layer.set_quant_method(method)
        layer.load_weight(weight, "w")
        with torch.no_grad():
            layer.bias.copy_(bias)
        layers.append(layer)
    return layers[0], layers[1]


# The check, in this process for the build loaded here and in a subprocess for the others (PAGEDSERVE_CPU_ISA).
CHECK = """
import os, sys, torch
sys.path.insert(0, os.getcwd())
from tests.models.test_q5_k_quant import bit_identity_failures
from models.layers import cpu_kernels
failures = bit_identity_failures()
print("BUILD", cpu_kernels.loaded_target())  # loaded by the first product
print("FAILURES", failures)
"""


def bit_identity_failures() -> list:
    """Cases where 5 bits with sub-scales differ in any bit from the float32-factor int5 form, or a row's
    result from that row alone: rows 1..70 (every tile shape and edge: decodes, `tile`'s 4-row tiles,
    AVX-512's 6 x 3 and 8 x 2 wide tiles), 1-3 threads, wide tiles on and off, and the fused silu."""
    failures = []
    threads = torch.get_num_threads()
    try:
        for n, k in ((37, 768), (208, 512), (16, 2304)):
            qw = quantized_weight(q5_k_blocks(n, k, seed=k), T.Q5_K, n, k)
            stored, plain = _layers(qw, n, k)
            x = torch.randn(70, k, generator=torch.Generator().manual_seed(k)) * 3
            x[0, 5] = 70.0
            for wide in ("1", "0"):
                with mock.patch.dict(os.environ, {"PAGEDSERVE_WIDE_TILES": wide}):
                    torch.set_num_threads(1)
                    alone = torch.cat([stored(x[i : i + 1]) for i in range(70)])
                    for num_threads in (1, 2, 3):
                        torch.set_num_threads(num_threads)
                        for rows in range(1, 71):
                            start = (7 * rows) % (71 - rows)
                            got = stored(x[start : start + rows])
                            if not torch.equal(got, plain(x[start : start + rows])):
                                failures.append(("plain", n, k, wide, num_threads, rows))
                            if not torch.equal(got, alone[start : start + rows]):
                                failures.append(("alone", n, k, wide, num_threads, rows))
                            if n % 16 == 0 and rows in (1, 2, 3, 8, 9, 33, 70):
                                fused = stored.quant_method.apply_silu_mul(stored, x[:rows], stored.bias, None)
                                want = plain.quant_method.apply_silu_mul(plain, x[:rows], plain.bias, None)
                                if fused is None or not torch.equal(fused, want):
                                    failures.append(("silu", n, k, wide, num_threads, rows))
    finally:
        torch.set_num_threads(threads)
    return failures


def test_q5_k_product_is_bit_identical_to_the_multiplied_out_int5():
    needs_kernel()
    assert bit_identity_failures() == []


@pytest.mark.slow
@pytest.mark.parametrize("target", ["avx2", "generic"])
def test_q5_k_product_is_bit_identical_on_the_other_builds(target):
    """AVX2's `tile` (its assembly tiles are 4 bits only) and the plain C++ build (builds the target where it
    is not built yet: minutes)."""
    if target not in {t.name for t in cpu_isa.supported(cpu_isa.read_cpu_flags())}:
        pytest.skip(f"this CPU does not run the {target} build")
    env = {**os.environ, "PAGEDSERVE_CPU_ISA": target}
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"BUILD {target}" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "FAILURES []" in out.stdout, out.stdout


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_q5_k_gguf_is_served_in_5_625_bits_with_the_bits_of_its_multiplied_out_form(tmp_path, tie):
    """Every layer (the tied embedding and head too) keeps the file's d, dmin, sc, mn and 5-bit values: 5.625
    bits a weight (the file's 5.5 with sc and mn a byte each) where the float32 factors took 7, the file's
    numbers exactly, and the model's logits the same bits as the float32-factor int5 form."""
    model = tiny_llama(tie=tie, hidden_size=256, intermediate_size=512, head_dim=64)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, T.Q5_K, quantizer=random_k_blocks)
    stored = load_model(str(path), dtype="float32")
    with mock.patch.dict(G.EXACT_FORMATS, {T.Q5_K: Q.StoredFormat(5, 32, torch.float32)}):  # the former form
        plain = load_model(str(path), dtype="float32")
    assert set(methods(stored.model).values()) == {"int5-k"}
    assert set(methods(plain.model).values()) == {"int5"}
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    layer = stored.model.model.layers[1].mlp.down_proj
    n, k = layer.out_features, layer.in_features
    blocks = np.asarray(tensor.data)
    assert np.array_equal(layer.quant_method.dense_weight(layer).numpy(), gguf_dequantize(blocks, T.Q5_K).reshape(n, k))
    held = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales, layer.mins))
    assert held * 8 == 5.625 * n * k and held * GGML_QUANT_SIZES[T.Q5_K][1] == blocks.nbytes * 180
    old = plain.model.model.layers[1].mlp.down_proj
    assert sum(t.numel() * t.element_size() for t in (old.qweight, old.scales, old.mins)) * 8 == 7 * n * k
    assert stored.weight_bytes < plain.weight_bytes * 0.85
    if cpu_kernels.available():
        assert layer.panelled and layer.qweight.shape == (-(-n // 8), k // 32, 176)
    got, want = prompt_logits(stored.model, PROMPT), prompt_logits(plain.model, PROMPT)
    assert torch.equal(got, want)
