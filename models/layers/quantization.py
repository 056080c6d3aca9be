"""Weight-only quantization: how a linear (or embedding) layer stores and multiplies its weight.

Each `Linear` holds a `LinearMethod`, chosen at load time (as vLLM's `quant_method`), so the
model files never branch on it:

    DenseMethod   weight (N, K) in the model's dtype; F.linear (oneDNN-packed for bf16 CPU)
    int8          qweight (N, K) int8, scales (N, K/G)                    w = s q
    int4          qweight (N, K/2) uint8 (two per byte), scales and mins  w = s q + m
                  (N, K/G), q in [0, 15]
    int5          qweight (N, K/32 * 20) uint8: int4's 16 bytes a group,  w = s q + m
                  then its 32 high bits (4 bytes), q in [0, 31]
    int6          qweight (N, K/32 * 26) uint8: int4's 16 bytes a group,  w = s sc (q - 32)
                  its 64 high bits (8 bytes), its two int8 sub-scales sc
                  (values 0..15, 16..31); scales (N, K/G) float16, G = 256
    int4 / int5   qweight (N, K/32 * 18 | 22) uint8: int4's 16 bytes a      w = s sc q + m mn
    with          group (int5's 20), then its uint8 sc and mn (6-bit
    sub-scales    values); scales, mins (N, K/G) float16, G = 256 (Q4_K's
                  and Q5_K's d and -dmin)
    int2 with     qweight (N, K/32 * 10) uint8: 8 bytes of 2-bit values,   w = s sc q + m mn
    sub-scales    then Q2_K's two scale bytes sc | mn << 4 (values 0..15,  (sc, mn per 16)
                  16..31); scales, mins (N, K/G) float16, G = 256 (d, -dmin)
    int4 through  qweight as int4's (IQ4_XS: each group's 16 bytes, then   w = s sc IQ4[q]
    a table       its int8 sc = ls - 32); scales (N, K/G) float16, G = 32
                  (IQ4_NL's d; sc 1) or 256 (IQ4_XS's d); IQ4 = IQ4_VALUES,
                  a fixed int8 codebook; no mins
    (QuantMethod) scales and mins float32, or float16 where a GGUF stores them so (a sixth
                  fewer bytes to read per 4-bit weight)

G is the group size along K, a multiple of 32. The layouts hold GGUF's blocks exactly
(models/gguf.py): Q8_0 is int8 with G = 32; Q4_0 (w = d (q - 8)) and Q4_1 (w = d q + m) are
int4 with G = 32; Q4_K (w = d sc q - dmin mn, 32-wide sub-blocks) is int4 with sub-scales (4.625
bits a weight), or where it joins other types int4 with G = 32 and d sc, -dmin mn multiplied out
(exact in float32: 11 by 6 significant bits); Q5_0 (w = d (q - 16)), Q5_1 and Q5_K are int5 the
same way (Q5_K with sub-scales: 5.625 bits a weight).
Q2_K (w = d sc q - dmin mn, 4-bit sc and mn per 16 values, q in [0, 3]) is int2 with sub-scales: the
file's 2.625 bits a weight; its per-16 mins fit no group of 32, so beside other types it is int8.
Q6_K (w = d sc (q - 32), an int8 sc per 16 values, an fp16 d per 256) is int6 with its d as the
scale (G = 256) and its sc inside the groups' bytes: the file's 6.5625 bits a weight. A dense
checkpoint is quantized at load by rounding to nearest (`quantize_int8`, `quantize_int4`): int8
per output channel (G = K), int4 with G = 32 (asymmetric, the min at the group's minimum).

    4-bit row layout (K = 64, two groups):  byte j of group g = q[g*32 + j] | q[g*32 + j + 16] << 4
        qweight[n] = [ group 0: 16 bytes | group 1: 16 bytes ]
    5-bit row layout: [ group 0: its 4-bit 16 bytes, then uint32 (little-endian) h | group 1: ... ],
        bit j of h = bit 4 of q[g*32 + j] (Q5_0's qh, behind its nibbles rather than before)
    6-bit row layout: [ group 0: its 4-bit 16 bytes, 8 bytes h, int8 sc0, int8 sc1 | group 1: ... ],
        bits 2j, 2j + 1 of h (little-endian) = bits 4, 5 of q[g*32 + j]
    with sub-scales: [ group 0: its 4-bit 16 bytes (or 5-bit 20), uint8 sc, uint8 mn | group 1: ... ]
    2-bit row layout: [ group 0: 8 bytes, byte j = q[j] | q[8 + j] << 2 | q[16 + j] << 4 | q[24 + j] << 6,
        then the scale bytes of values 0..15 and 16..31 | group 1: ... ]

On CPU the products run in models/layers/csrc/quant_linear.cpp (integer dot products, the
activations rounded to int16 per 32 values), over the weights reordered once into panels of
8 output columns (`to_panels`; the loader does it after loading, a layer used on its own at
its first product):

    qweight (P, K/32, 128 | 160 | 208 | 256) bytes, P = ceil(N / 8): panel p's group g holds columns
            8p .. 8p+7's 2-byte units of group g, unit-major: [unit 0 of column 0..7 | unit 1 ...];
            5 bits: the 4-bit 128 bytes, then the group's high bits in 32 bytes (`_HIGH_BIT`);
            6 bits: the 4-bit 128 bytes, the high bits in 64 (`_HIGH_BITS6`), then sc0 of the 8
            columns and sc1 of the 8 columns (16 bytes); with sub-scales: the group's bytes as
            without, then sc of the 8 columns and mn of the 8 columns (16 bytes: 144 for 4 bits,
            176 for 5); 2 bits: the 2-bit 64 bytes, then the 8 columns' first scale bytes and their
            second (80)
    scales, mins (P, K/G, 8)

`dequantize` + F.linear is the reference that the kernel is tested against and the path
where it is not built, or for activations kept in float (`quantize_input=False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from gguf.quants import IQ4_NL
from torch import nn

from models.layers import cpu_kernels
from models.layers.step_kernels import StepKernels

BLOCK = 32  # the quantized kernels' unit along K
PANEL = 8  # output columns per panel of the CPU kernel's weight layout
QUANTIZATIONS = ("auto", "none", "int8", "int4")
BITS = (2, 4, 5, 6, 8)
# stored bytes per 32 values of a row; 6 bits: 16 of nibbles, 8 of high bits, 2 of sub-scales
_GROUP_BYTES = {2: BLOCK // 4, 4: BLOCK // 2, 5: BLOCK // 2 + BLOCK // 8, 6: BLOCK // 2 + BLOCK // 4 + 2, 8: BLOCK}
_PANEL_GROUP_BYTES = {bits: PANEL * size for bits, size in _GROUP_BYTES.items()}  # 64, 128, 160, 208, 256
INT6_GROUP = 256  # int6's scale (Q6_K's d) covers 256 values
K_GROUP = 256  # a K-quant's super-block: its d and dmin cover 256 values
_SUB_SCALE_BYTES = 2  # a K-quant group's uint8 sub-scale and sub-min, behind its value bytes
# IQ4_NL's and IQ4_XS's codebook, gguf-py's own: w = scale * IQ4_VALUES[q]
IQ4_VALUES = torch.tensor(IQ4_NL.kvalues, dtype=torch.int8)
TABLE_KIND = 0x200  # quant_linear's `bits` for 4-bit indices into IQ4_VALUES: 4 | TABLE_KIND


def group_bytes(bits: int, sub_scales: bool = False, table: bool = False) -> int:
    """A stored row's bytes per 32 values (with `sub_scales`: the group's sc and mn behind them; through
    the `table`, IQ4_XS's one int8 sc)."""
    return _GROUP_BYTES[bits] + ((1 if table else _SUB_SCALE_BYTES) if sub_scales else 0)


class StoredFormat(NamedTuple):
    """How a checkpoint tensor is kept: `bits`, the scales' `group_size` and dtype, and for 4 and 5
    bits whether each group of 32 carries its K-quant sub-scale and sub-min (`sub_scales`); for 4 bits
    whether its values index IQ4_VALUES (`table`: IQ4_NL, IQ4_XS with its int8 sub-scale)."""

    bits: int
    group_size: int
    scale_dtype: torch.dtype
    sub_scales: bool = False
    table: bool = False


@dataclass
class QuantizedWeight:
    """A quantized weight as a checkpoint stores it, before it is copied into a layer.

    Rows may be split (merged projections) or permuted (GGUF's Q/K order) like a dense
    weight: quantization groups run along K, within a row.
    """

    bits: int  # 2 (with sub-scales only), 4, 5, 6 or 8
    qweight: torch.Tensor  # (N, K/2) uint8 | (N, K/32 * 20) uint8 | (N, K/32 * 26) uint8 | (N, K) int8
    scales: torch.Tensor  # (N, K/G) float32 or float16
    mins: torch.Tensor | None  # (N, K/G) like scales, 4 and 5 bits only
    in_features: int
    # 4 and 5 bits (Q4_K, Q5_K as stored): each group's bytes end in its uint8 sc and mn (the 6-bit
    # sub-scale and sub-min), scales and mins are the super-block's d and -dmin: w = d sc q + (-dmin) mn;
    # 2 bits (Q2_K): the two bytes are its scale bytes sc | mn << 4 of each 16 values
    sub_scales: bool = False
    # 4 bits (IQ4_NL, IQ4_XS as stored): q indexes IQ4_VALUES, no mins; with sub_scales each group's 16
    # bytes end in its int8 ls - 32 (IQ4_XS), scales the fp16 d per 256: w = d (ls - 32) IQ4_VALUES[q]
    table: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.in_features)

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        mins = None if self.mins is None else self.mins[index]
        return QuantizedWeight(
            self.bits, self.qweight[index], self.scales[index], mins, self.in_features, self.sub_scales, self.table
        )

    def without_sub_scales(self) -> QuantizedWeight:
        """The same numbers in groups of 32 with float32 scales d * sc and mins -dmin * mn, both exact
        (11 by 6 significant bits): the form a K-quant part takes in a layer of other types."""
        if not self.sub_scales:
            return self
        values, sc, mn = split_sub_scales(self.qweight, self.bits, self.in_features, self.table)
        per_group = self.group_size // BLOCK
        if self.table:  # IQ4_XS: d * (ls - 32), exact (11 by 5 significant bits), as gguf-py's
            scales = self.scales.float().repeat_interleave(per_group, dim=1) * sc.view(torch.int8).float()
            return QuantizedWeight(self.bits, values, scales, None, self.in_features, table=True)
        scales = self.scales.float().repeat_interleave(per_group, dim=1) * sc.float()  # (N, K/32)
        assert self.mins is not None
        mins = self.mins.float().repeat_interleave(per_group, dim=1) * mn.float()
        return QuantizedWeight(self.bits, values, scales, mins, self.in_features)

    def columns(self, part: slice, name: str) -> QuantizedWeight:
        """Inputs `part` of every row (a row-parallel rank's share): whole groups only, or any
        32-aligned part of a weight with one scale per row (int8 per channel keeps its scale)."""
        g = self.group_size
        cut = self.sub_scales and (part.start % g or part.stop % g) and not (part.start % BLOCK or part.stop % BLOCK)
        if cut and self.bits == 2:  # Q2_K's per-16 mins fit no group of 32: int8 requantized
            return quantize_int8(self.dequantize()[:, part], BLOCK)
        if cut:
            return self.without_sub_scales().columns(part, name)  # a cut super-block: its groups of 32
        if self.scales.shape[1] == 1 and self.bits == 8 and not (part.start % BLOCK or part.stop % BLOCK):
            return QuantizedWeight(8, self.qweight[:, part], self.scales, None, part.stop - part.start)
        if part.start % g or part.stop % g:
            raise ValueError(
                f"tensor {name!r}: a tensor-parallel split of its {self.in_features} inputs at "
                f"{part.start}..{part.stop} cuts its quantization groups of {g}; choose a tensor parallel "
                f"size that divides {self.in_features // g} groups, or load it with --quantization none"
            )
        size = group_bytes(self.bits, self.sub_scales, self.table)  # a row's bytes per 32 values
        groups = slice(part.start // g, part.stop // g)
        return QuantizedWeight(
            self.bits,
            self.qweight[:, part.start // BLOCK * size : part.stop // BLOCK * size],
            self.scales[:, groups],
            None if self.mins is None else self.mins[:, groups],
            part.stop - part.start,
            self.sub_scales,
            self.table,
        )

    def as_int8(self) -> QuantizedWeight:
        """A table form's numbers as int8 in groups of 32, exactly: each q through IQ4_VALUES, the scale d
        (IQ4_XS: d * (ls - 32) in float32). The form an IQ4 part takes in an int8 layer."""
        plain = self.without_sub_scales()
        values = IQ4_VALUES[unpack_int4(plain.qweight, plain.in_features).long()]
        return QuantizedWeight(8, values, plain.scales, None, plain.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.bits == 2:
            return dequantize_int2(self.qweight, self.scales, self.mins, self.in_features).to(dtype)
        qw = self.without_sub_scales()  # d * sc q + (-dmin) mn: gguf-py's d * sc * q - dmin * mn, bit for bit
        if qw.table:  # gguf-py's (d or d * (ls - 32)) * float(IQ4_VALUES[q]), bit for bit
            n, groups = qw.scales.shape
            values = IQ4_VALUES[unpack_int4(qw.qweight, qw.in_features).long()].float().view(n, groups, -1)
            return (qw.scales.float().unsqueeze(-1) * values).view(n, qw.in_features).to(dtype)
        return dequantize(qw.bits, qw.qweight, qw.scales, qw.mins, qw.in_features).to(dtype)


def unpack_int4(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 values in [0, 15], GGUF's order within each group of 32."""
    n = qweight.shape[0]
    groups = qweight.view(n, in_features // BLOCK, BLOCK // 2)  # (N, K/32, 16)
    return torch.cat((groups & 0x0F, groups >> 4), dim=-1).view(n, in_features)  # (N, K)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 15] -> (N, K/2) uint8, the inverse of unpack_int4."""
    n, k = q.shape
    groups = q.to(torch.uint8).view(n, k // BLOCK, BLOCK)  # (N, K/32, 32)
    return (groups[..., : BLOCK // 2] | (groups[..., BLOCK // 2 :] << 4)).reshape(n, k // 2)


_BIT = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)
_TWO_BIT_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def _to_bits(t: torch.Tensor) -> torch.Tensor:
    """uint8 (..., B) -> (..., 8 B) of 0 / 1, little-endian: byte b's bit j at 8 b + j."""
    return (t.unsqueeze(-1) & _BIT).ne(0).to(torch.uint8).flatten(-2)


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """The inverse of _to_bits: (..., 8 B) of 0 / 1 -> (..., B) uint8 (in uint8 throughout: a
    wider intermediate is 8 bytes a bit of a whole layer's weights)."""
    planes = bits.view(*bits.shape[:-1], -1, 8)
    out = planes[..., 0].clone()
    for j in range(1, 8):
        out |= planes[..., j] << j
    return out


def unpack_int5(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """(N, K/32 * 20) uint8 -> (N, K) uint8 values in [0, 31]."""
    n = qweight.shape[0]
    groups = qweight.view(n, in_features // BLOCK, _GROUP_BYTES[5])  # (N, K/32, 20)
    low = unpack_int4(groups[..., : BLOCK // 2].reshape(n, -1), in_features)
    return low | (_to_bits(groups[..., BLOCK // 2 :]).view(n, in_features) << 4)


def pack_int5(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 31] -> (N, K/32 * 20) uint8, the inverse of unpack_int5."""
    n, k = q.shape
    q = q.to(torch.uint8)
    low = pack_int4(q & 0x0F).view(n, k // BLOCK, BLOCK // 2)
    high = _from_bits((q >> 4).view(n, k // BLOCK, BLOCK))  # (N, K/32, 4)
    return torch.cat((low, high), dim=-1).reshape(n, -1)


def pack_int6(q: torch.Tensor, sub_scales: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 63] and (N, K/16) int8 sub-scales -> (N, K/32 * 26) uint8."""
    n, k = q.shape
    q = q.to(torch.uint8)
    low = pack_int4(q & 0x0F).view(n, k // BLOCK, BLOCK // 2)
    # bits 2j, 2j + 1 of a group's 8 high bytes: bits 4, 5 of its value j (four values a byte)
    two = (q >> 4).view(n, k // BLOCK, BLOCK // 4, 4)
    high = two[..., 0] | (two[..., 1] << 2) | (two[..., 2] << 4) | (two[..., 3] << 6)  # (N, K/32, 8)
    sc = sub_scales.to(torch.int8).view(torch.uint8).view(n, k // BLOCK, 2)
    return torch.cat((low, high, sc), dim=-1).reshape(n, -1)


def unpack_int6(qweight: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K/32 * 26) uint8 -> values (N, K) uint8 in [0, 63], sub-scales (N, K/16) int8."""
    n = qweight.shape[0]
    groups = qweight.view(n, in_features // BLOCK, _GROUP_BYTES[6])  # (N, K/32, 26)
    low = unpack_int4(groups[..., : BLOCK // 2].reshape(n, -1), in_features)
    high = groups[..., BLOCK // 2 : BLOCK // 2 + 8].unsqueeze(-1) >> _TWO_BIT_SHIFTS  # (N, K/32, 8, 4)
    q = low | ((high & 0x03).view(n, in_features) << 4)
    sc = groups[..., BLOCK // 2 + 8 :].contiguous().view(torch.int8).reshape(n, -1)  # (N, K/16)
    return q, sc


def pack_int2(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 3] -> (N, K/32 * 8) uint8: byte j of a group holds its values j, 8 + j, 16 + j,
    24 + j at bits 0, 2, 4, 6 (a chunk of a panel then holds both sub-blocks' values, csrc/quant_linear.cpp)."""
    n, k = q.shape
    four = q.to(torch.uint8).view(n, k // BLOCK, 4, BLOCK // 4)  # (N, K/32, 4, 8)
    return (four[..., 0, :] | four[..., 1, :] << 2 | four[..., 2, :] << 4 | four[..., 3, :] << 6).reshape(n, -1)


def unpack_int2(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """(N, K/32 * 8) uint8 -> (N, K) uint8 values in [0, 3], the inverse of pack_int2."""
    n = qweight.shape[0]
    shifts = _TWO_BIT_SHIFTS.to(qweight.device).view(4, 1)  # a device's weights dequantized per call
    groups = qweight.reshape(n, in_features // BLOCK, 1, BLOCK // 4) >> shifts  # (N, K/32, 4, 8)
    return (groups & 0x03).reshape(n, in_features)


def dequantize_int2(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, in_features: int
) -> torch.Tensor:
    """Q2_K's int2 with sub-scales -> float32 (N, K): (d sc) q + (-dmin mn) per 16 values, gguf-py's
    d * sc * q - dmin * mn bit for bit (both products exact in float32: 11 by 4 significant bits)."""
    assert mins is not None
    n, groups = scales.shape
    values, lo, hi = split_sub_scales(qweight, 2, in_features)
    q = unpack_int2(values, in_features).float().view(n, -1, 16)  # (N, K/16, 16)
    both = torch.stack((lo, hi), dim=-1).reshape(n, -1)  # (N, K/16): sub-block s's byte sc | mn << 4
    per = in_features // 16 // groups
    step = scales.float().repeat_interleave(per, dim=1) * (both & 0x0F).float()
    low = mins.float().repeat_interleave(per, dim=1) * (both >> 4).float()
    return (q * step.unsqueeze(-1) + low.unsqueeze(-1)).view(n, in_features)


def with_sub_scales(qweight: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor | None) -> torch.Tensor:
    """(N, K/32 * B) stored values and (N, K/32) uint8 sc, mn -> (N, K/32 * (B + 2)): each group's
    B bytes, then its sc and mn (no mn: IQ4_XS's sc alone, B + 1)."""
    n, groups = sc.shape
    sc = sc.view(torch.uint8) if sc.dtype == torch.int8 else sc.to(torch.uint8)  # IQ4_XS's int8 as its byte
    parts = [qweight.reshape(n, groups, -1), sc.view(n, groups, 1)]
    if mn is not None:
        parts.append(mn.to(torch.uint8).view(n, groups, 1))
    return torch.cat(parts, dim=-1).reshape(n, -1)


def split_sub_scales(
    qweight: torch.Tensor, bits: int, in_features: int, table: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of with_sub_scales: (values (N, K/32 * B), sc (N, K/32), mn (N, K/32) or None)."""
    n = qweight.shape[0]
    groups = qweight.reshape(n, in_features // BLOCK, group_bytes(bits, True, table))
    size = _GROUP_BYTES[bits]
    return groups[..., :size].reshape(n, -1), groups[..., size], None if table else groups[..., size + 1]


def unpack(bits: int, qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """The stored integers (N, K): uint8 in [0, 15], [0, 31] or [0, 63] (6 bits), or int8."""
    if bits == 4:
        return unpack_int4(qweight, in_features)
    if bits == 2:
        return unpack_int2(split_sub_scales(qweight, 2, in_features)[0], in_features)
    if bits == 6:
        return unpack_int6(qweight, in_features)[0]
    return unpack_int5(qweight, in_features) if bits == 5 else qweight


def dequantize(
    bits: int, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, in_features: int
) -> torch.Tensor:
    """The reference: the float32 weight (N, K) that a quantized weight stands for."""
    n, groups = scales.shape
    if bits == 6:  # d * sc exactly in float32 (11 by 8 significant bits), times q - 32 exactly, as gguf-py
        q, sc = unpack_int6(qweight, in_features)
        step = scales.float().repeat_interleave(sc.shape[1] // groups, dim=1) * sc.float()  # (N, K/16)
        return ((q.float() - 32).view(n, -1, 16) * step.unsqueeze(-1)).view(n, in_features)
    q = unpack(bits, qweight, in_features)
    w = q.float().view(n, groups, -1) * scales.float().unsqueeze(-1)  # (N, K/G, G)
    if mins is not None:
        w += mins.float().unsqueeze(-1)
    return w.view(n, in_features)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:]))) if rows > t.shape[0] else t


def _high_bit_order() -> torch.Tensor:
    """A 5-bit panel group's high-bit plane: bit b of its byte 16 h + 2 i + t is the high bit of
    value k of the panel's column i (an index i * 32 + k into the panel's (8, 32) values), where
    chunk c = 4 h + b % 4 of the 4-bit stream holds the pair (2c + t, 16 + 2c + t) of column i in
    its lane 2 i + t: b < 4 the low nibble's value (k = 2c + t), b >= 4 the high one's (+ 16).
    Widened to 16 int16 lanes, half h gives each lane of chunks 4h .. 4h+3 its two bits."""
    order = torch.empty(32, 8, dtype=torch.long)
    for byte in range(32):
        h, i, t = byte // 16, byte % 16 // 2, byte % 2
        for b in range(8):
            c = 4 * h + b % 4
            order[byte, b] = i * BLOCK + 2 * c + t + (16 if b >= 4 else 0)
    return order


_HIGH_BIT = _high_bit_order()  # (32 bytes, 8 bits) -> index into a panel group's (8 columns, 32 values)


def _high_bits6_order() -> torch.Tensor:
    """A 6-bit panel group's high-bit plane: bit b of its byte 16 h + 2 i + t is bit 4 + b % 2 of value
    k of the panel's column i (an index into the panel's (8, 32, 2) high bits), where chunk c = 2 h + b % 4
    // 2 of the 4-bit stream holds the pair (2c + t, 16 + 2c + t) of column i in its lane 2 i + t: b < 4
    the low nibble's value (k = 2c + t), b >= 4 the high one's (+ 16). Widened to 16 int16 lanes, chunk
    h gives each lane of chunks 2h, 2h + 1 its four bits."""
    order = torch.empty(64, 8, dtype=torch.long)
    for byte in range(64):
        h, i, t = byte // 16, byte % 16 // 2, byte % 2
        for b in range(8):
            c = 2 * h + b % 4 // 2
            k = 2 * c + t + (16 if b >= 4 else 0)
            order[byte, b] = (i * BLOCK + k) * 2 + b % 2
    return order


_HIGH_BITS6 = _high_bits6_order()  # (64 bytes, 8 bits) -> index into a panel group's (8, 32, 2) high bits


def to_panels(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """qweight, scales, mins in the CPU kernel's panels of 8 columns (N padded with zeros):
    a reorder of 2-byte units (and for 5 bits, of the high bits), nothing more
    (csrc/quant_linear.cpp draws it). Reordered a slice of rows at a time into the result, so
    that loading needs the layer's bytes plus a bounded scratch, whatever the layer's size (the
    bit planes take a byte a bit: a 150k-row output layer at once took ~10 GB)."""
    rows = max(PANEL, _PANEL_CHUNK_BYTES // max(1, qw.qweight[:1].nbytes) // PANEL * PANEL)
    if qw.shape[0] <= rows:
        return _to_panels(qw)
    panels = -(-qw.shape[0] // PANEL)
    out: list[torch.Tensor | None] = []
    for start in range(0, qw.shape[0], rows):
        part = _to_panels(qw.rows(slice(start, start + rows)))
        if not out:
            out = [None if t is None else t.new_empty(panels, *t.shape[1:]) for t in part]
        for whole, t in zip(out, part):
            if whole is not None and t is not None:
                whole[start // PANEL : start // PANEL + t.shape[0]] = t
    qweight, scales, mins = out
    assert qweight is not None and scales is not None
    return qweight, scales, mins


_PANEL_CHUNK_BYTES = 4 << 20  # stored bytes reordered at a time by `to_panels`


def _to_panels(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    n, k = qw.shape
    padded = -(-n // PANEL) * PANEL
    nb = k // BLOCK
    stored = _pad_rows(qw.qweight, padded)
    k_factors = None
    if qw.sub_scales:  # (P, nb, 16): the 8 columns' sc, then their mn, behind the panel group's values
        stored, sc, mn = split_sub_scales(stored, qw.bits, k, qw.table)
        both = (sc,) if mn is None else (sc, mn)  # IQ4_XS: (P, nb, 8), the sc alone
        k_factors = torch.stack(both, dim=-1).view(padded // PANEL, PANEL, nb, len(both)).permute(0, 2, 3, 1)
        k_factors = k_factors.reshape(padded // PANEL, nb, len(both) * PANEL)
    if qw.bits == 6:
        groups = stored.view(padded, nb, _GROUP_BYTES[6])
        stored = groups[..., : BLOCK // 2].reshape(padded, -1)
        values = _to_bits(groups[..., BLOCK // 2 : BLOCK // 2 + 8])  # (N, nb, 64): 2 high bits a value
        values = values.view(padded // PANEL, PANEL, nb, 2 * BLOCK).transpose(1, 2).reshape(padded // PANEL, nb, -1)
        sub = groups[..., BLOCK // 2 + 8 :].reshape(padded // PANEL, PANEL, nb, 2).permute(0, 2, 3, 1)  # (P, nb, 2, 8)
        high = torch.cat((_from_bits(values[..., _HIGH_BITS6].flatten(-2)), sub.reshape(padded // PANEL, nb, -1)), -1)
    elif qw.bits == 5:
        groups = stored.view(padded, nb, _GROUP_BYTES[5])
        stored = groups[..., : BLOCK // 2].reshape(padded, -1)
        values = _to_bits(groups[..., BLOCK // 2 :])  # (N, nb, 32) high bits
        values = values.view(padded // PANEL, PANEL, nb, BLOCK).transpose(1, 2).reshape(padded // PANEL, nb, -1)
        high = _from_bits(values[..., _HIGH_BIT].flatten(-2))  # (P, nb, 32)
    units = stored.reshape(padded // PANEL, PANEL, nb, -1, 2)  # (P, 8, nb, u, 2)
    qweight = units.permute(0, 2, 3, 1, 4).reshape(padded // PANEL, nb, -1)
    if qw.bits in (5, 6):
        qweight = torch.cat((qweight, high), dim=-1)
    if k_factors is not None:
        qweight = torch.cat((qweight, k_factors), dim=-1)

    def factors(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return _pad_rows(t, padded).view(padded // PANEL, PANEL, -1).transpose(1, 2).contiguous()

    return qweight.contiguous(), factors(qw.scales), factors(qw.mins)


def panel_rows(
    bits: int,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    rows: torch.Tensor,
    sub_scales: bool = False,
    table: bool = False,
) -> QuantizedWeight:
    """Rows `rows` (output columns) of panelled weights, back in the stored layout."""
    panels, nb, _ = qweight.shape
    if sub_scales and table:  # IQ4_XS: the values as IQ4_NL's, then each row's sc from the last 8 bytes
        own = qweight[rows // PANEL]  # (R, nb, bytes)
        lane, r = rows % PANEL, torch.arange(rows.numel())
        values = panel_rows(bits, own[..., :-PANEL], scales[rows // PANEL], None, r * PANEL + lane)
        sc = own[..., -PANEL:][r, :, lane]  # (R, nb)
        packed = with_sub_scales(values.qweight, sc, None)
        return QuantizedWeight(bits, packed, values.scales, None, values.in_features, True, True)
    if sub_scales:  # the values as without, then each row's sc and mn from the panel group's last 16 bytes
        # The rows' own panels first (row i in panel i), so that cutting off the sc and mn copies only those:
        # an embedding lookup reads a few rows of a large table.
        own = qweight[rows // PANEL]  # (R, nb, bytes)
        lane, r = rows % PANEL, torch.arange(rows.numel())
        factors = [None if f is None else f[rows // PANEL] for f in (scales, mins)]
        values = panel_rows(bits, own[..., : -2 * PANEL], factors[0], factors[1], r * PANEL + lane)
        sub = own[..., -2 * PANEL :].reshape(rows.numel(), nb, 2, PANEL)[r, :, :, lane]  # (R, nb, 2)
        packed = with_sub_scales(values.qweight, sub[..., 0], sub[..., 1])
        return QuantizedWeight(bits, packed, values.scales, values.mins, values.in_features, True)
    panel, lane = rows // PANEL, rows % PANEL
    low = qweight[..., : _PANEL_GROUP_BYTES[4]] if bits in (5, 6) else qweight  # 2 bits: all of it (4 units)
    q = low.reshape(panels, nb, -1, PANEL, 2)[panel, :, :, lane, :].reshape(rows.numel(), nb, -1)  # (R, nb, u*2)
    if bits == 6:
        order = torch.empty(PANEL * BLOCK * 2, dtype=torch.long)
        order[_HIGH_BITS6.flatten()] = torch.arange(PANEL * BLOCK * 2)
        plane = qweight[panel, :, _PANEL_GROUP_BYTES[4] : _PANEL_GROUP_BYTES[4] + 64]  # (R, nb, 64)
        values = _to_bits(plane)[..., order].view(rows.numel(), nb, PANEL, 2 * BLOCK)
        high = _from_bits(values[torch.arange(rows.numel()), :, lane])  # (R, nb, 8)
        sub = qweight[panel, :, _PANEL_GROUP_BYTES[4] + 64 :].view(rows.numel(), nb, 2, PANEL)
        sub = sub[torch.arange(rows.numel()), :, :, lane]  # (R, nb, 2)
        q = torch.cat((q, high, sub), dim=-1)
    elif bits == 5:
        order = torch.empty(PANEL * BLOCK, dtype=torch.long)
        order[_HIGH_BIT.flatten()] = torch.arange(PANEL * BLOCK)
        values = _to_bits(qweight[panel, :, _PANEL_GROUP_BYTES[4] :])[..., order]  # (R, nb, 8 * 32)
        high = values.view(rows.numel(), nb, PANEL, BLOCK)[torch.arange(rows.numel()), :, lane]  # (R, nb, 32)
        q = torch.cat((q, _from_bits(high)), dim=-1)

    def lanes(factors: torch.Tensor | None) -> torch.Tensor | None:  # (P, S, 8) -> (len(rows), S)
        return None if factors is None else factors[panel, :, lane]

    return QuantizedWeight(bits, q.reshape(rows.numel(), -1), lanes(scales), lanes(mins), nb * BLOCK, table=table)


def quantized_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, panels: tuple | None = None
) -> torch.Tensor:
    """x W^T (+ bias) on the CPU kernel, from `qw` or its `to_panels(qw)` (tests, benchmarks:
    a model's layers go through QuantMethod)."""
    qweight, scales, mins = panels if panels is not None else to_panels(qw)
    bits = qw.bits | (TABLE_KIND if qw.table else 0)
    return cpu_kernels.quant_linear(x, qweight, scales, mins, bias, bits, qw.group_size, qw.shape[0], 0.0)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Round to nearest, symmetric, one scale per output channel (or per `group_size` values)."""
    n, k = weight.shape
    g = group_size or k
    w = weight.detach().float().view(n, k // g, g)  # (N, K/G, G)
    scales = w.abs().amax(dim=-1) / 127.0  # (N, K/G)
    q = torch.round(w / scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp(-127, 127)
    return QuantizedWeight(8, q.to(torch.int8).view(n, k).contiguous(), scales.contiguous(), None, k)


def quantize_int4(weight: torch.Tensor, group_size: int = BLOCK, bits: int = 4) -> QuantizedWeight:
    """Round to nearest, asymmetric: each group maps [min, max] onto 0..15 (`bits` 5: 0..31)."""
    n, k = weight.shape
    top = (1 << bits) - 1
    w = weight.detach().float().view(n, k // group_size, group_size)  # (N, K/G, G)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # (N, K/G)
    scales = (hi - lo) / top
    q = torch.round((w - lo.unsqueeze(-1)) / scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1))
    q = q.clamp(0, top).view(n, k)
    return QuantizedWeight(bits, pack_int4(q) if bits == 4 else pack_int5(q), scales.contiguous(), lo.contiguous(), k)


def quantize_int5(weight: torch.Tensor, group_size: int = BLOCK) -> QuantizedWeight:
    return quantize_int4(weight, group_size, bits=5)


def quantize_k(weight: torch.Tensor, group_size: int = K_GROUP, bits: int = 4) -> QuantizedWeight:
    """Round to nearest in Q4_K's (`bits` 5: Q5_K's) form: each 32 values' asymmetric scale and min
    (as quantize_int4, the min clamped to <= 0) as 6-bit multiples sc, mn of an fp16 d and dmin per
    `group_size`, then q to the rounded factors."""
    n, k = weight.shape
    top = (1 << bits) - 1
    w = weight.detach().float().view(n, k // group_size, group_size // BLOCK, BLOCK)  # (N, K/G, G/32, 32)
    lo = w.amin(dim=-1).clamp(max=0)
    step = (w.amax(dim=-1) - lo) / top  # (N, K/G, G/32)
    d, dmin = (step.amax(dim=-1) / 63).half(), (-lo.amin(dim=-1) / 63).half()  # (N, K/G)
    sc = torch.round(step / torch.where(d == 0, 1.0, d.float()).unsqueeze(-1)).clamp(0, 63)
    mn = torch.round(-lo / torch.where(dmin == 0, 1.0, dmin.float()).unsqueeze(-1)).clamp(0, 63)
    scale, low = d.float().unsqueeze(-1) * sc, -dmin.float().unsqueeze(-1) * mn  # exact, as the kernel's
    q = torch.round((w - low.unsqueeze(-1)) / scale.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1))
    q = q.clamp(0, top).view(n, k)
    values = pack_int4(q) if bits == 4 else pack_int5(q)
    packed = with_sub_scales(values, sc.to(torch.uint8).view(n, -1), mn.to(torch.uint8).view(n, -1))
    return QuantizedWeight(bits, packed, d.contiguous(), (-dmin).contiguous(), k, True)


def quantize_iq4(weight: torch.Tensor, group_size: int = BLOCK, sub_scales: bool = False) -> QuantizedWeight:
    """Round to nearest in IQ4_NL's form (fp16 d per 32, d = the group's largest-|w| value / -127) or with
    `sub_scales` IQ4_XS's (each 32's step an int8 multiple ls - 32 in [-32, 31] of an fp16 d per
    `group_size`), then each q the nearest of the table's 16 values times the group's factor."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group_size, group_size // BLOCK, BLOCK)  # (N, K/G, G/32, 32)
    peak = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)  # (N, K/G, G/32)
    step = peak / -127
    if sub_scales:
        d = (step.abs().amax(dim=-1) / 32).half()  # (N, K/G)
        sc = torch.round(step / torch.where(d == 0, 1.0, d.float()).unsqueeze(-1)).clamp(-32, 31)
        factor = d.float().unsqueeze(-1) * sc  # exact, as the kernel's
    else:
        d = step.half().view(n, -1)
        factor = d.float().view(step.shape)
    # the nearest table value to w / factor (|w - f t| = |f| |w / f - t|): between the sorted values' midpoints
    table = IQ4_VALUES.float()
    ratio = w / torch.where(factor == 0, 1.0, factor).unsqueeze(-1)
    q = torch.bucketize(ratio, (table[1:] + table[:-1]) / 2).view(n, k)
    values = pack_int4(q)
    if sub_scales:
        values = with_sub_scales(values, sc.to(torch.int8).view(n, -1), None)
    return QuantizedWeight(4, values, d.contiguous(), None, k, sub_scales, table=True)


def quantize_int6(weight: torch.Tensor, group_size: int = INT6_GROUP) -> QuantizedWeight:
    """Round to nearest in Q6_K's form: per 16 values a scale to +-31 (the sub-block's largest |w|),
    per `group_size` an fp16 d with each sub-scale an int8 multiple of it, then q to the product."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group_size, group_size // 16, 16)  # (N, K/G, G/16, 16)
    step = w.abs().amax(dim=-1) / 31  # (N, K/G, G/16)
    d = (step.amax(dim=-1) / 127).half()  # (N, K/G)
    # Divided by d itself, subnormal or not (trained weights' d is often below fp16's smallest normal):
    # only an all-zero group (d = 0) takes 1, for sub-scales 0.
    divisor = torch.where(d == 0, 1.0, d.float()).unsqueeze(-1)
    sc = torch.round(step / divisor).clamp(-128, 127)
    exact = d.float().unsqueeze(-1) * sc  # (N, K/G, G/16)
    q = torch.round(w / exact.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp(-32, 31) + 32
    return QuantizedWeight(6, pack_int6(q.view(n, k), sc.to(torch.int8).view(n, -1)), d.contiguous(), None, k)


# ---- per-layer methods ------------------------------------------------------------------


class LinearMethod:
    """How a layer stores its weight and computes x W^T. One instance may serve many layers."""

    name = "dense"

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, kernels: StepKernels) -> torch.Tensor:
        """x W^T + b on the kernels the step chose (models/layers/step_kernels.py)."""
        raise NotImplementedError

    def apply_silu_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, kernels: StepKernels
    ) -> torch.Tensor | None:
        """silu(gate) * up of a [gate | up] layer's x W^T + b in one kernel, or None where this
        method has none for x (the caller runs `apply` and silu_and_mul)."""
        return None

    def load(self, layer: nn.Module, rows: slice, weight: torch.Tensor | QuantizedWeight, name: str) -> None:
        """Copy (a row range of) a checkpoint weight, quantizing or dequantizing as needed."""
        raise NotImplementedError

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight as a float tensor (N, K): the reference, and the embedding lookup's rows."""
        raise NotImplementedError

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> bool:
        """Once all of the layer's weights are loaded: put them in the layout a kernel runs on,
        once (True: they are in it now)."""
        return False

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        """The dtype of the layer's activations (its dense weight's, or the model's)."""
        return layer.compute_dtype

    def weight_names(self) -> tuple[str, ...]:
        raise NotImplementedError


class DenseMethod(LinearMethod):
    name = "dense"

    def create_weights(self, layer, out_features, in_features):
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def apply(self, layer, x, bias, kernels):
        packed = layer.packed_weight
        if packed is None and layer.weight.is_mkldnn:
            packed = layer.weight
        # One row in a step on torch's kernels (the runner chooses them for single-token
        # steps, engine/threads.py): torch's own gemv over the plain weight, when one is kept.
        if packed is not None and (packed is layer.weight or x.shape[0] > 1 or kernels.onednn):
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return kernels.matmul(F.linear, x, layer.weight, bias)

    def load(self, layer, rows, weight, name):
        dst = layer.weight[rows]
        if isinstance(weight, QuantizedWeight):
            weight = weight.dequantize()
        _check_shape_of(tuple(weight.shape), tuple(dst.shape), name)
        with torch.no_grad():
            dst.copy_(weight)

    def dense_weight(self, layer):
        return layer.weight

    def embedding(self, layer, ids):
        return F.embedding(ids, layer.weight)

    def compute_dtype(self, layer):
        return layer.weight.dtype

    def weight_names(self):
        return ("weight",)


class RowsDenseMethod(DenseMethod):
    """Dense weights on csrc/rows_matmul.cpp (`--batch-invariant`): each output one FMA chain over
    the row's inputs, in an order of its row alone, so a token's logits are the same bits whatever
    its step (neighbours, row count, prefix-cache hits, thread count), as quantized layers are
    (CausalLM.row_invariant). torch's GEMMs (MKL, oneDNN) round a row by the step's row count.
    Weights stay plain (never oneDNN-packed). Its speed against torch's depends on the CPU: on an
    AVX2 Zen 3 it was faster but for bf16's one-row decode (docs/benchmarks.md); where oneDNN
    takes bf16 its GEMMs should win. Off the CPU kernels (other devices, no compiler) it is
    DenseMethod."""

    name = "dense-batch-invariant"
    row_invariant = True

    def apply(self, layer, x, bias, kernels):
        if not (x.device.type == "cpu" and cpu_kernels.available()):
            return super().apply(layer, x, bias, kernels)
        out = cpu_kernels.rows_matmul(x, layer.weight, False)  # (T, N) float32
        if bias is not None:
            out += bias
        return out if out.dtype == x.dtype else out.to(x.dtype)


ROWS_DENSE = RowsDenseMethod()


class QuantMethod(LinearMethod):
    """Int8 (`bits=8`, symmetric), int4 or int5 (`bits=4`, `bits=5`: scale + min; with `sub_scales`,
    Q4_K's or Q5_K's d and -dmin per group and uint8 sc, mn per 32), int6 (`bits=6`: Q6_K's d per 256
    and int8 sub-scales per 16), int2 (`bits=2`, with `sub_scales` only: Q2_K's d, -dmin per group and
    4-bit sc, mn per 16) weights in groups along K; `table`: 4 bits indexing IQ4_VALUES, symmetric
    (IQ4_NL's d per 32; with `sub_scales` IQ4_XS's d per 256 and int8 ls - 32 per 32)."""

    def __init__(
        self,
        bits: int,
        group_size: int | None,
        quantize_input: bool = True,
        scale_dtype: torch.dtype = torch.float32,
        sub_scales: bool = False,
        table: bool = False,
    ):
        if bits not in BITS:
            raise ValueError(f"bits must be 2, 4, 5, 6 or 8, got {bits}")
        if scale_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"scale_dtype must be float32 or float16, got {scale_dtype}")
        if sub_scales and (bits not in (2, 4, 5) or group_size is None or group_size % BLOCK):
            raise ValueError("sub_scales are for 2, 4 or 5 bits in groups of a multiple of 32 (a K-quant's d per 256)")
        if bits == 2 and not sub_scales:
            raise ValueError("2 bits are Q2_K's, with its sub-scales")
        if table and bits != 4:
            raise ValueError("table is for 4 bits (IQ4_NL, IQ4_XS)")
        self.bits = bits
        self.table = table  # IQ4_NL / IQ4_XS as stored: q indexes IQ4_VALUES, no mins
        self.sub_scales = sub_scales  # Q4_K / Q5_K as stored: d, -dmin per group, sc and mn per 32 in the bytes
        self.group_size = group_size  # None: one group per row (int8 per channel)
        self.scale_dtype = scale_dtype
        # quantize_input: round activations to int16 per 32 values for integer dot products
        # (csrc/quant_linear.cpp says why int16, not llama.cpp's int8); else the reference,
        # F.linear over the dequantized weight.
        self.quantize_input = quantize_input
        self.name = ("iq4" if table else f"int{bits}") + ("-xs" if table and sub_scales else "-k" if sub_scales else "")
        # quant_linear's `bits`: the table's values are told from int4's by a flag, not by their bytes
        self.kernel_bits = bits | (TABLE_KIND if table else 0)

    @property
    def has_mins(self) -> bool:
        return self.bits in (2, 4, 5) and not self.table

    def _groups(self, in_features: int) -> int:
        return in_features // (self.group_size or in_features)

    def create_weights(self, layer, out_features, in_features):
        cols = in_features // BLOCK * group_bytes(self.bits, self.sub_scales, self.table)
        qdtype = torch.int8 if self.bits == 8 else torch.uint8
        layer.qweight = nn.Parameter(torch.empty(out_features, cols, dtype=qdtype), requires_grad=False)
        groups = self._groups(in_features)
        layer.scales = nn.Parameter(torch.empty(out_features, groups, dtype=self.scale_dtype), requires_grad=False)
        if self.has_mins:
            layer.mins = nn.Parameter(torch.empty(out_features, groups, dtype=self.scale_dtype), requires_grad=False)

    def _stored(self, layer, rows: torch.Tensor | None = None) -> QuantizedWeight:
        """The weight (or rows of it) in the stored layout, whether or not it is in panels."""
        mins = getattr(layer, "mins", None)
        if mins is None and getattr(layer, "min_per_scale", 0):
            mins = layer.scales * layer.min_per_scale  # exact: a power of two
        if getattr(layer, "panelled", False):
            rows = torch.arange(layer.out_features) if rows is None else rows
            return panel_rows(self.bits, layer.qweight, layer.scales, mins, rows, self.sub_scales, self.table)
        weight = QuantizedWeight(
            self.bits, layer.qweight, layer.scales, mins, layer.in_features, self.sub_scales, self.table
        )
        return weight if rows is None else weight.rows(rows)

    def process_weights_after_loading(self, layer) -> bool:
        """Reorder the layer's weights into the CPU kernel's panels, once (False: they stay as
        stored, for a device or a build without the kernel). Mins that are the scales times -8
        (GGUF's Q4_0: w = d (q - 8)) are dropped and made from the scales as the kernel runs:
        a sixth fewer bytes to read per weight, the same numbers; likewise -16 for 5 bits (Q5_0)."""
        if getattr(layer, "panelled", False):
            return True
        if layer.qweight.device.type != "cpu" or not cpu_kernels.available():
            return False
        stored = self._stored(layer)
        zero_point = -float(1 << (self.bits - 1))  # -8, -16: Q4_0's, Q5_0's
        offset = (
            self.has_mins
            and not self.sub_scales  # -dmin multiplies mn, not q: never a zero point
            and stored.mins is not None
            and torch.equal(stored.mins, stored.scales * zero_point)
        )
        qweight, scales, mins = to_panels(stored)
        layer.qweight = nn.Parameter(qweight, requires_grad=False)
        layer.scales = nn.Parameter(scales, requires_grad=False)
        if mins is not None:
            layer.mins = None if offset else nn.Parameter(mins, requires_grad=False)
        layer.min_per_scale = zero_point if offset else 0.0
        layer.panelled = True
        return True

    def apply(self, layer, x, bias, kernels):
        if (
            x.device.type == "cpu"
            and x.dim() == 2
            and self.quantize_input
            and self.process_weights_after_loading(layer)
        ):
            # One kernel for every row count (a decode, a batch, a prefill): its result for a
            # row depends on that row alone, never on the step's size or the thread count.
            return cpu_kernels.quant_linear(
                x,
                layer.qweight,
                layer.scales,
                layer.mins if self.has_mins else None,
                bias,
                self.kernel_bits,
                layer.in_features // layer.scales.shape[1],
                layer.out_features,
                layer.min_per_scale,
            )
        return kernels.matmul(F.linear, x, self.dense_weight(layer).to(x.dtype), bias)

    def apply_silu_mul(self, layer, x, bias, kernels):
        # The product and silu_and_mul in one pass (csrc/quant_linear.cpp, quant_linear_silu_mul):
        # the same numbers, without the (rows, 2 * intermediate) output between them.
        if (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and self.quantize_input
            and layer.out_features % 16 == 0
            and self.process_weights_after_loading(layer)
        ):
            return cpu_kernels.quant_linear_silu_mul(
                x,
                layer.qweight,
                layer.scales,
                layer.mins if self.has_mins else None,
                bias,
                self.kernel_bits,
                layer.in_features // layer.scales.shape[1],
                layer.out_features,
                layer.min_per_scale,
            )
        return None

    def load(self, layer, rows, weight, name):
        if getattr(layer, "panelled", False):
            raise RuntimeError(f"tensor {name!r}: the layer's weights are already reordered for the CPU kernel")
        expected = (len(range(*rows.indices(layer.out_features))), layer.in_features)
        _check_shape_of(tuple(weight.shape), expected, name)
        if (
            isinstance(weight, QuantizedWeight)
            and weight.sub_scales
            and not self.sub_scales
            and weight.bits != 2
            and weight.table == self.table
        ):
            # a K-quant part of a layer of other types (or of --quantization int4): exactly, float32 factors
            # (Q2_K's per-16 mins have no such form: requantized below)
            weight = weight.without_sub_scales()
        if isinstance(weight, QuantizedWeight) and weight.table and self.bits == 8 and self.group_size == BLOCK:
            weight = weight.as_int8()  # exactly: the table's values are int8's
        if isinstance(weight, QuantizedWeight) and weight.bits == 4 and self.bits == 5 and not weight.table:
            # exactly: the same numbers with the high bits 0 (a merged layer of Q4 and Q5 parts)
            weight = QuantizedWeight(
                5,
                pack_int5(unpack_int4(weight.qweight, weight.in_features)),
                weight.scales,
                weight.mins,
                weight.in_features,
            )
        if not isinstance(weight, QuantizedWeight) or not self._compatible(weight, layer.in_features):
            weight = self.quantize(weight.dequantize() if isinstance(weight, QuantizedWeight) else weight)
        with torch.no_grad():
            layer.qweight[rows].copy_(weight.qweight)
            layer.scales[rows].copy_(weight.scales)
            if self.has_mins:
                layer.mins[rows].copy_(weight.mins if weight.mins is not None else torch.zeros_like(weight.scales))
            factors = [layer.scales[rows]] + ([layer.mins[rows]] if self.has_mins else [])
            if not all(torch.isfinite(f).all() for f in factors):
                raise ValueError(f"tensor {name!r}: quantization scales are not finite ({self.scale_dtype})")

    def _compatible(self, weight: QuantizedWeight, in_features: int) -> bool:
        return (
            weight.bits == self.bits
            and weight.sub_scales == self.sub_scales
            and weight.table == self.table
            and weight.in_features == in_features
            and weight.scales.shape[1] == self._groups(in_features)
            and (weight.scales.dtype == self.scale_dtype or self.scale_dtype == torch.float32)
        )

    def quantize(self, weight: torch.Tensor) -> QuantizedWeight:
        if self.table:
            return quantize_iq4(weight, self.group_size or BLOCK, self.sub_scales)
        if self.bits == 8:
            return quantize_int8(weight, self.group_size)
        if self.bits == 6:
            return quantize_int6(weight, self.group_size or INT6_GROUP)
        if self.bits == 2:
            raise ValueError("2 bits hold a Q2_K checkpoint's weights as stored; no dense weight is rounded to them")
        if self.sub_scales:
            return quantize_k(weight, self.group_size or K_GROUP, bits=self.bits)
        return quantize_int4(weight, self.group_size or BLOCK, bits=self.bits)

    def dense_weight(self, layer):
        return self._stored(layer).dequantize()

    def embedding(self, layer, ids):
        rows = self._stored(layer, ids.reshape(-1))
        return rows.dequantize(layer.compute_dtype).view(*ids.shape, layer.in_features)

    def weight_names(self):
        return ("qweight", "scales", "mins") if self.has_mins else ("qweight", "scales")


def _check_shape_of(shape: tuple, expected: tuple, name: str) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(shape)} != model shape {tuple(expected)}")


DENSE = DenseMethod()


def method_for(
    bits: int | None,
    group_size: int | None,
    in_features: int,
    scale_dtype: torch.dtype = torch.float32,
    sub_scales: bool = False,
    table: bool = False,
) -> LinearMethod:
    """The method for a layer of `in_features` inputs: quantized when the format fits, else dense.
    A K-quant's (IQ4_XS's) super-blocks that do not fit (a tensor-parallel share) fall back to its groups
    of 32."""
    if bits is None:
        return DENSE
    if sub_scales:
        g = group_size or K_GROUP
        if in_features % g == 0:
            return QuantMethod(bits, g, scale_dtype=scale_dtype, sub_scales=True, table=table)
        if bits == 2:
            return method_for(8, BLOCK, in_features)  # Q2_K's per-16 mins: int8
        return method_for(bits, BLOCK, in_features, table=table)
    if table:
        return QuantMethod(bits, BLOCK, scale_dtype=scale_dtype, table=True) if in_features % BLOCK == 0 else DENSE
    g = group_size if group_size is not None else (None if bits == 8 else INT6_GROUP if bits == 6 else BLOCK)
    if in_features % BLOCK or (g is not None and (g % BLOCK or in_features % g)):
        return DENSE
    return QuantMethod(bits, g, scale_dtype=scale_dtype)
