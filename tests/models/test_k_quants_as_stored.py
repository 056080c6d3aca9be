"""Q4_K and Q5_K served in their own form (4 or 5 bits with sub-scales: each group of 32 its values' bytes,
then its 6-bit sc and mn as uint8; the layer's scales and mins the fp16 d and -dmin per 256): the file's
numbers bit for bit, and kernel outputs bit-identical to the same weight with d * sc and -dmin * mn
multiplied out into float32 factors (groups of 32), on every tile family that runs the bits (AVX-512
VNNI's wide tiles and `tile`; for 4 bits AVX2's assembly tiles; the plain C++ build), row count and thread
count."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
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
from tests.models.test_quantization import PROMPT, methods, needs_kernel, prompt_logits

T = GGMLQuantizationType
REPO = Path(__file__).resolve().parents[2]
FP16_EXTREMES = np.array([65504.0, 6e-8, 6.1e-5, 1e-4, 0.013, 0.0], dtype=np.float16)  # max, subnormals, 0


@dataclass(frozen=True)
class KQuant:
    qtype: GGMLQuantizationType
    bits: int
    row_bytes: int  # a stored row's bytes per 32 values: the values, then sc and mn
    old_bits: int  # a weight's bits with the factors multiplied out (float32 scale and min per 32)
    beside: dict  # another part's type in a merged layer -> the method that takes both

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def bits_a_weight(self) -> float:
        return self.row_bytes * 8 / 32 + 32 / 256  # fp16 d and -dmin per 256

    @property
    def panel_bytes(self) -> int:
        return self.row_bytes * 8


# Q4_K beside Q6_K is int8 as for Q5_K: int6 is Q6_K's (and Q3_K's) alone.
KQUANTS = {
    "Q4_K": KQuant(T.Q4_K, 4, 18, 6, {T.Q4_0: "int4", T.Q5_0: "int5", T.Q6_K: "int8"}),
    "Q5_K": KQuant(T.Q5_K, 5, 22, 7, {T.Q5_0: "int5", T.Q4_K: "int5", T.Q4_0: "int5", T.Q6_K: "int8"}),
}
kquants = pytest.mark.parametrize("kq", list(KQUANTS.values()), ids=list(KQUANTS))


def k_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0, extreme: bool = False) -> np.ndarray:
    """Random Q4_K or Q5_K blocks: a model's small d and dmin, or (`extreme`) fp16's largest, subnormal and zero
    ones with sc and mn all 0 or all 63 in some blocks (both types begin d, dmin, 12 bytes of sc and mn)."""
    blocks = random_k_blocks(np.zeros((rows, cols), dtype=np.float32), qtype, seed).reshape(rows, cols // 256, -1)
    if extreme:
        rng = np.random.default_rng(seed)
        for at in (0, 2):  # d, dmin
            blocks[..., at : at + 2] = rng.choice(FP16_EXTREMES, blocks.shape[:2])[..., None].view(np.uint8)
        blocks[0, 0, 4:16] = 0xFF  # every sc and mn 63
        blocks[-1, -1, 4:16] = 0  # every sc and mn 0
    return blocks.reshape(rows, -1)


@kquants
def test_blocks_map_exactly_onto_their_bits_with_sub_scales(kq):
    rows, cols = 7, 1024
    data = k_blocks(kq.qtype, rows, cols, extreme=True)
    want = gguf_dequantize(data, kq.qtype).reshape(rows, cols)
    got = quantized_weight(data, kq.qtype, rows, cols)
    assert got.bits == kq.bits and got.sub_scales and got.group_size == 256
    assert got.qweight.shape == (rows, cols // 32 * kq.row_bytes)
    assert got.scales.dtype == got.mins.dtype == torch.float16
    assert np.array_equal(got.dequantize().numpy(), want, equal_nan=True)  # bit for bit, infinities too
    plain = got.without_sub_scales()  # the form a part takes beside other types
    assert plain.group_size == 32 and plain.scales.dtype == torch.float32
    assert np.array_equal(plain.dequantize().numpy(), want, equal_nan=True)
    assert serving_format(kq.qtype) == Q.StoredFormat(kq.bits, 256, torch.float16, sub_scales=True)


@kquants
@pytest.mark.parametrize("n", [37, 8])
def test_panels_hold_the_stored_weight_and_give_back_any_rows(kq, n):
    qw = quantized_weight(k_blocks(kq.qtype, n, 768, seed=n), kq.qtype, n, 768)
    qweight, scales, mins = Q.to_panels(qw)
    assert qweight.shape == (-(-n // 8), 24, kq.panel_bytes) and scales.shape == mins.shape == (-(-n // 8), 3, 8)
    for rows in (torch.arange(n), torch.tensor([n - 1, 0, 3, 3])):
        back = Q.panel_rows(kq.bits, qweight, scales, mins, rows, sub_scales=True)
        want = qw.rows(rows)
        assert back.sub_scales and torch.equal(back.qweight, want.qweight)
        assert torch.equal(back.scales, want.scales) and torch.equal(back.mins, want.mins)


@kquants
def test_tensor_parallel_columns_keep_whole_super_blocks_or_fall_back_to_groups_of_32(kq):
    qw = quantized_weight(k_blocks(kq.qtype, 6, 1024), kq.qtype, 6, 1024)
    dense = qw.dequantize()
    half = qw.columns(slice(512, 1024), "w")
    assert half.sub_scales and torch.equal(half.dequantize(), dense[:, 512:])
    cut = qw.columns(slice(0, 352), "w")  # 352 = 11 groups of 32: super-block 2 is cut
    assert not cut.sub_scales and torch.equal(cut.dequantize(), dense[:, :352])


@kquants
def test_merged_layers_keep_the_form_alone_and_exact_beside_other_types(kq):
    others = {f"a.{t.name}.weight": serving_format(t) for t in kq.beside}
    formats = {"a.q.weight": serving_format(kq.qtype), "a.k.weight": serving_format(kq.qtype), **others}
    choose = choose_methods("auto", formats.get)
    alone = choose(["a.q.weight", "a.k.weight"], 512)
    assert alone.name == f"int{kq.bits}-k" and alone.group_size == 256 and alone.scale_dtype == torch.float16
    exact = [alone]
    for other, name in kq.beside.items():
        method = choose(["a.q.weight", f"a.{other.name}.weight"], 512)
        assert method.name == name, other
        if name != "int8":  # float32 factors: d * sc is no fp16 (int8: requantized, as before)
            assert method.group_size == 32 and method.scale_dtype == torch.float32, other
            exact.append(method)
    share = choose(["a.q.weight"], 4480)  # a tensor-parallel share of 17.5 super-blocks: groups of 32
    assert share.name == f"int{kq.bits}" and share.group_size == 32
    # each loads the file's numbers exactly
    qw = quantized_weight(k_blocks(kq.qtype, 16, 512), kq.qtype, 16, 512)
    for method in exact:
        layer = Linear(512, 16, bias=False)
        layer.set_quant_method(method)
        layer.load_weight(qw, "w")
        assert torch.equal(method.dense_weight(layer), qw.dequantize()), method.name


def _layers(kq: KQuant, qw: Q.QuantizedWeight, n: int, k: int) -> tuple[Linear, Linear]:
    """(qw as stored, qw with its factors multiplied out into float32 ones), both with a bias."""
    stored = Q.QuantMethod(kq.bits, 256, scale_dtype=torch.float16, sub_scales=True)
    return biased_layers(n, k, ((stored, qw), (Q.QuantMethod(kq.bits, 32), qw.without_sub_scales())))


def biased_layers(n: int, k: int, pairs) -> tuple[Linear, Linear]:
    """Two (k -> n) layers of (method, weight) pairs, with the same random bias."""
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    layers = []
    for method, weight in pairs:
        layer = Linear(k, n, bias=True)
        layer.set_quant_method(method)
        layer.load_weight(weight, "w")
        with torch.no_grad():
            layer.bias.copy_(bias)
        layers.append(layer)
    return layers[0], layers[1]


# The check, in this process for the build loaded here and in a subprocess for the others (PAGEDSERVE_CPU_ISA):
# module.build_failures(name) of the test module named.
CHECK = """
import importlib, os, sys, torch
sys.path.insert(0, os.getcwd())
from models.layers import cpu_kernels
failures = importlib.import_module(sys.argv[1]).build_failures(sys.argv[2])
print("BUILD", cpu_kernels.loaded_target())  # loaded by the first product
print("FAILURES", failures)
"""


def build_failures(name: str) -> list:
    return bit_identity_failures(KQUANTS[name])


def bit_identity_failures(kq, blocks=k_blocks, layers=_layers) -> list:
    """Cases where the form as stored differs in any bit from its reference form (`layers`: here the
    float32-factor one), or a row's result from that row alone: rows 1..70 (every tile shape and edge:
    decodes, `tile`'s 4-row tiles, AVX2's 4 x 2 and sliced 4 x 3 tiles for 4 bits, AVX-512's 6 x 3 and 8 x 2
    wide tiles), 1-3 threads, wide tiles on and off, and the fused silu."""
    failures = []
    threads = torch.get_num_threads()
    try:
        for n, k in ((37, 768), (208, 512), (16, 2304)):
            qw = quantized_weight(blocks(kq.qtype, n, k, seed=k), kq.qtype, n, k)
            stored, plain = layers(kq, qw, n, k)
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


@kquants
def test_product_is_bit_identical_to_the_multiplied_out_form(kq):
    needs_kernel()
    assert bit_identity_failures(kq) == []


@pytest.mark.slow
@kquants
@pytest.mark.parametrize("target", ["avx2", "generic"])
def test_product_is_bit_identical_on_the_other_builds(kq, target):
    """AVX2 (4 bits: its assembly 4 x 3 tiles, the factors made per group, then read as float32 ones; 5 bits:
    `tile`) and the plain C++ build (builds the target where it is not built yet: minutes)."""
    assert_no_failures_on_build("tests.models.test_k_quants_as_stored", kq.name, target)


def assert_no_failures_on_build(module: str, name: str, target: str) -> None:
    """`module`.build_failures(`name`) is empty on the `target` build, in a subprocess."""
    if target not in {t.name for t in cpu_isa.supported(cpu_isa.read_cpu_flags())}:
        pytest.skip(f"this CPU does not run the {target} build")
    env = {**os.environ, "PAGEDSERVE_CPU_ISA": target}
    command = [sys.executable, "-c", CHECK, module, name]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"BUILD {target}" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "FAILURES []" in out.stdout, out.stdout


@kquants
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_gguf_is_served_as_stored_with_the_bits_of_its_multiplied_out_form(tmp_path, kq, tie):
    """Every layer (the tied embedding and head too) keeps the file's d, dmin, sc, mn and values: 4.625 or
    5.625 bits a weight (the file's 4.5 or 5.5 with sc and mn a byte each) where the float32 factors took 6
    or 7, the file's numbers exactly, and the model's logits the same bits as the float32-factor form."""
    model = tiny_llama(tie=tie, hidden_size=256, intermediate_size=512, head_dim=64)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, kq.qtype, quantizer=random_k_blocks)
    stored = load_model(str(path), dtype="float32")
    former = Q.StoredFormat(kq.bits, 32, torch.float32)
    with mock.patch.dict(G.EXACT_FORMATS, {kq.qtype: former}):
        plain = load_model(str(path), dtype="float32")
    assert set(methods(stored.model).values()) == {f"int{kq.bits}-k"}
    assert set(methods(plain.model).values()) == {f"int{kq.bits}"}
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    layer = stored.model.model.layers[1].mlp.down_proj
    n, k = layer.out_features, layer.in_features
    blocks = np.asarray(tensor.data)
    want = gguf_dequantize(blocks, kq.qtype).reshape(n, k)
    assert np.array_equal(layer.quant_method.dense_weight(layer).numpy(), want)
    held = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales, layer.mins))
    assert held * 8 == kq.bits_a_weight * n * k
    assert held * GGML_QUANT_SIZES[kq.qtype][1] == blocks.nbytes * kq.bits_a_weight * 256 / 8
    old = plain.model.model.layers[1].mlp.down_proj
    assert sum(t.numel() * t.element_size() for t in (old.qweight, old.scales, old.mins)) * 8 == kq.old_bits * n * k
    assert stored.weight_bytes < plain.weight_bytes * 0.85
    if cpu_kernels.available():
        assert layer.panelled and layer.qweight.shape == (-(-n // 8), k // 32, kq.panel_bytes)
    got, want_logits = prompt_logits(stored.model, PROMPT), prompt_logits(plain.model, PROMPT)
    assert torch.equal(got, want_logits)
