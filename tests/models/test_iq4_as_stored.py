"""IQ4_NL and IQ4_XS served in their own form (4 bits through a table: each group of 32 its 16 bytes of
nibbles, indices into the IQ4 codebook; IQ4_NL's fp16 d per 32, IQ4_XS's fp16 d per 256 and its int8
ls - 32 behind each group's bytes): the file's numbers bit for bit, and kernel outputs bit-identical to
the same values as int8 (each q mapped through the table, d or d * (ls - 32) per 32 as the scale), on
every tile family (AVX-512 VNNI's wide tiles and `tile` on AVX2, AVX-512 and the plain C++ build), row
count and thread count."""

from __future__ import annotations

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
from models.layers import cpu_kernels
from models.layers import quantization as Q
from models.layers.linear import Linear
from models.loader import choose_methods, load_model
from tests.models.test_gguf import random_k_blocks, tiny_llama, write_gguf
from tests.models.test_k_quants_as_stored import assert_no_failures_on_build, biased_layers, bit_identity_failures
from tests.models.test_quantization import PROMPT, methods, needs_kernel, prompt_logits

T = GGMLQuantizationType
REPO = Path(__file__).resolve().parents[2]
FP16_EXTREMES = np.array([65504.0, -65504.0, 6e-8, -6.1e-5, 1e-4, 0.013, 0.0], dtype=np.float16)


@dataclass(frozen=True)
class IQ4:
    qtype: GGMLQuantizationType
    group_size: int  # the fp16 d's
    row_bytes: int  # a stored row's bytes per 32 values: 16 of nibbles (IQ4_XS: then its ls - 32)
    name_served: str

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def sub_scales(self) -> bool:
        return self.qtype == T.IQ4_XS

    @property
    def bits_a_weight(self) -> float:
        return self.row_bytes * 8 / 32 + 16 / self.group_size

    @property
    def panel_bytes(self) -> int:
        return self.row_bytes * 8


IQ4S = {"IQ4_NL": IQ4(T.IQ4_NL, 32, 16, "iq4"), "IQ4_XS": IQ4(T.IQ4_XS, 256, 17, "iq4-xs")}
iq4s = pytest.mark.parametrize("iq", list(IQ4S.values()), ids=list(IQ4S))


def iq4_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0, extreme: bool = False) -> np.ndarray:
    """Random IQ4_NL or IQ4_XS blocks (a model's small d), or (`extreme`) fp16's largest, subnormal and zero d,
    with IQ4_XS's ls all 0 or all 63 in some blocks (both types begin with d)."""
    blocks = random_k_blocks(np.zeros((rows, cols), dtype=np.float32), qtype, seed)
    blocks = blocks.reshape(rows, cols // GGML_QUANT_SIZES[qtype][0], -1)
    if extreme:
        rng = np.random.default_rng(seed)
        blocks[..., 0:2] = rng.choice(FP16_EXTREMES, blocks.shape[:2])[..., None].view(np.uint8)
        if qtype == T.IQ4_XS:
            blocks[0, 0, 2:8] = 0xFF  # every ls 63: sc 31
            blocks[-1, -1, 2:8] = 0  # every ls 0: sc -32
    return blocks.reshape(rows, -1)


@iq4s
def test_blocks_map_exactly_onto_their_nibbles_and_scales(iq):
    rows, cols = 7, 1024
    data = iq4_blocks(iq.qtype, rows, cols, extreme=True)
    stored = quantized_weight(data, iq.qtype, rows, cols)
    assert (stored.bits, stored.table, stored.sub_scales, stored.mins) == (4, True, iq.sub_scales, None)
    assert stored.qweight.shape == (rows, cols // 32 * iq.row_bytes) and stored.group_size == iq.group_size
    assert stored.scales.dtype == torch.float16
    # gguf-py's values bit for bit: as stored, in groups of 32 (IQ4_XS's d * (ls - 32) in float32), as int8
    file = gguf_dequantize(data, iq.qtype).reshape(rows, cols)
    plain = stored.without_sub_scales()
    assert plain.group_size == 32 and plain.table
    for form in (stored, plain, stored.as_int8()):
        assert np.array_equal(form.dequantize().numpy(), file, equal_nan=True)
    assert serving_format(iq.qtype) == Q.StoredFormat(4, iq.group_size, torch.float16, iq.sub_scales, table=True)
    if iq.sub_scales:  # every ls value 0..63: 8 a super-block, in 8 files' worth of blocks
        blocks = data.reshape(rows, cols // 256, -1)[:2].copy()
        for first in range(0, 64, 8):
            ls = np.arange(first, first + 8)
            blocks[..., 4:8] = (ls[0::2] & 0x0F) | ((ls[1::2] & 0x0F) << 4)
            blocks[..., 2:4] = np.array([((ls >> 4) << (2 * np.arange(8))).sum()], dtype=np.uint16).view(np.uint8)
            some = blocks.reshape(2, -1)
            want = gguf_dequantize(some, iq.qtype).reshape(2, cols)
            assert np.array_equal(quantized_weight(some, iq.qtype, 2, cols).dequantize().numpy(), want, equal_nan=True)


@iq4s
@pytest.mark.parametrize("n", [37, 8])
def test_panels_hold_the_stored_weight_and_give_back_any_rows(iq, n):
    qw = quantized_weight(iq4_blocks(iq.qtype, n, 768, seed=n), iq.qtype, n, 768)
    qweight, scales, mins = Q.to_panels(qw)
    assert qweight.shape == (-(-n // 8), 24, iq.panel_bytes) and mins is None
    assert scales.shape == (-(-n // 8), 768 // iq.group_size, 8)
    for rows in (torch.arange(n), torch.tensor([n - 1, 0, 3, 3])):
        back = Q.panel_rows(4, qweight, scales, None, rows, iq.sub_scales, table=True)
        want = qw.rows(rows)
        assert back.table and back.sub_scales == iq.sub_scales and torch.equal(back.qweight, want.qweight)
        assert torch.equal(back.scales, want.scales) and back.mins is None


@iq4s
def test_tensor_parallel_columns_keep_whole_blocks_or_fall_back_to_groups_of_32(iq):
    qw = quantized_weight(iq4_blocks(iq.qtype, 6, 1024), iq.qtype, 6, 1024)
    dense = qw.dequantize()
    half = qw.columns(slice(512, 1024), "w")
    assert half.table and half.sub_scales == iq.sub_scales and torch.equal(half.dequantize(), dense[:, 512:])
    cut = qw.columns(slice(0, 352), "w")  # 11 groups of 32: IQ4_XS's super-block 2 is cut
    assert cut.table and not cut.sub_scales and torch.equal(cut.dequantize(), dense[:, :352])


def test_layers_keep_the_table_alone_and_beside_each_other():
    formats = {"a.nl.weight": serving_format(T.IQ4_NL), "a.xs.weight": serving_format(T.IQ4_XS)}
    formats["a.q4.weight"] = serving_format(T.Q4_0)
    choose = choose_methods("auto", formats.get)
    assert choose(["a.nl.weight"], 512).name == "iq4"
    xs = choose(["a.xs.weight"], 512)
    assert xs.name == "iq4-xs" and xs.group_size == 256 and xs.scale_dtype == torch.float16
    assert choose(["a.xs.weight"], 896).name == "iq4"  # 3.5 super-blocks: groups of 32, d * (ls - 32) in float32
    both = choose(["a.nl.weight", "a.xs.weight"], 512)
    assert both.name == "iq4" and both.scale_dtype == torch.float32
    assert choose(["a.nl.weight", "a.q4.weight"], 512).name == "int4"  # beside another type: requantized, as before
    assert choose_methods("int4", formats.get)(["a.nl.weight"], 512).name == "int4"
    for method, qtype in ((both, T.IQ4_NL), (both, T.IQ4_XS), (xs, T.IQ4_XS)):
        qw = quantized_weight(iq4_blocks(qtype, 16, 512), qtype, 16, 512)
        layer = Linear(512, 16, bias=False)
        layer.set_quant_method(method)
        layer.load_weight(qw, "w")
        assert torch.equal(method.dense_weight(layer), qw.dequantize()), (method.name, qtype)


def _layers(iq: IQ4, qw: Q.QuantizedWeight, n: int, k: int) -> tuple[Linear, Linear]:
    """(qw as stored, the same numbers as int8), both with a bias."""
    int8 = qw.as_int8()
    stored = Q.QuantMethod(4, iq.group_size, scale_dtype=torch.float16, sub_scales=iq.sub_scales, table=True)
    return biased_layers(n, k, ((stored, qw), (Q.QuantMethod(8, 32, scale_dtype=int8.scales.dtype), int8)))


def build_failures(name: str) -> list:
    """The K-quants' check (test_k_quants_as_stored) with the int8 form as the reference."""
    return bit_identity_failures(IQ4S[name], iq4_blocks, _layers)


@iq4s
def test_product_is_bit_identical_to_the_int8_form(iq):
    needs_kernel()
    assert build_failures(iq.name) == []


@iq4s
def test_product_is_within_int16_activations_of_the_dequantized_weight(iq):
    needs_kernel()
    n, k = 40, 768
    qw = quantized_weight(iq4_blocks(iq.qtype, n, k, seed=3), iq.qtype, n, k)
    stored, _ = _layers(iq, qw, n, k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k)) * 3
    x[0, 5] = 70.0
    blocks = x.view(9, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    x_rounded = (torch.round(blocks / d) * d).view(9, k)
    want = torch.nn.functional.linear(x_rounded.double(), qw.dequantize().double(), stored.bias.double())
    got = stored(x).double()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.slow
@iq4s
@pytest.mark.parametrize("target", ["avx2", "generic"])
def test_product_is_bit_identical_on_the_other_builds(iq, target):
    """AVX2 (`tile`: a byte shuffle through the table; the assembly tiles are int4's alone) and the plain C++
    build (builds the target where it is not built yet: minutes)."""
    assert_no_failures_on_build("tests.models.test_iq4_as_stored", iq.name, target)


@iq4s
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_gguf_is_served_as_stored_with_the_bits_of_its_int8_form(tmp_path, iq, tie):
    """Every layer (the tied embedding and head too) keeps the file's d (and ls) and nibbles: 4.5 bits a
    weight (IQ4_NL's own), 4.3125 (IQ4_XS's 4.25, ls - 32 a byte) where int4 requantized took 6, the file's
    numbers exactly, and the model's logits the same bits as the int8 form of the same numbers."""
    model = tiny_llama(tie=tie, hidden_size=256, intermediate_size=512, head_dim=64)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, iq.qtype, quantizer=random_k_blocks)
    stored = load_model(str(path), dtype="float32")
    with mock.patch.dict(G.EXACT_FORMATS, {iq.qtype: Q.StoredFormat(8, 32, torch.float32)}):
        as_int8_model = load_model(str(path), dtype="float32")
    with mock.patch.dict(G.EXACT_FORMATS):
        del G.EXACT_FORMATS[iq.qtype]  # the former requantized int4
        former = load_model(str(path), dtype="float32")
    assert set(methods(stored.model).values()) == {iq.name_served}
    assert set(methods(former.model).values()) == {"int4"}
    layer = stored.model.model.layers[1].mlp.down_proj
    assert getattr(layer, "mins", None) is None
    n, k = layer.out_features, layer.in_features
    assert sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales)) * 8 == iq.bits_a_weight * n * k
    down = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    file = gguf_dequantize(np.asarray(down.data), iq.qtype).reshape(n, k)
    assert np.array_equal(layer.quant_method.dense_weight(layer).numpy(), file)
    old = former.model.model.layers[1].mlp.down_proj
    assert sum(t.numel() * t.element_size() for t in (old.qweight, old.scales, old.mins)) * 8 == 6 * n * k
    assert stored.weight_bytes < former.weight_bytes * 0.85
    if cpu_kernels.available():
        assert layer.panelled and layer.qweight.shape == (-(-n // 8), k // 32, iq.panel_bytes)
    got, want_logits = prompt_logits(stored.model, PROMPT), prompt_logits(as_int8_model.model, PROMPT)
    assert torch.equal(got, want_logits)
