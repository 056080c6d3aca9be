"""Weight-only quantized matmuls on this CPU: torch's own kernels against ours, one after the other.

    python -m loadtest.bench_quant [--shape smollm2-1.7b] [--rows 1 4 16 64] [--threads 2] [--stat median]

The linear layers of a SmolLM2 shape (loadtest/make_gguf.py's SHAPES; default 135M: qkv
960x576, o 576x576, gate_up 3072x576, down 576x1536, x 30 layers), random weights, each row
count timed as the best of `--repeats` runs (the machine is shared: the best run is what the
code costs), with the GFLOP/s equivalent (2 x rows x weights / time) of ours and of the float32
GEMM over the weights dequantized beforehand (what steps of many rows ran before the integer
kernel took every step). Columns: dense float32 and bfloat16
(F.linear), torch's int8 per-channel and int4 group-32 weight-only kernels (what torchao's CPU
layouts call; fast only with bf16 activations), and ours (models/layers/csrc/quant_linear.cpp,
float32 activations rounded to int16 inside) in int4, int5 (float32 scale and min, the form a Q4_K or
Q5_K part takes beside other types; Q5_0's: float16 scales, min = -16 x scale), int4 and int5 with
sub-scales (GGUF Q4_K's and Q5_K's form: an fp16 d and -dmin per 256, 6-bit sc and mn per 32), int6
(GGUF Q6_K's form: an fp16 d per 256, int8 sub-scales per 16), int2 with sub-scales (GGUF Q2_K's form: an
fp16 d and -dmin per 256, 4-bit sc and mn per 16; random blocks, as its time does not depend on the numbers)
and int8, groups of 32. `--shape qwen2.5-1.5b`: Qwen2.5-1.5B's layers (hidden
1536, intermediate 8960, 12 heads of 128, 2 KV heads, 28 layers). `--interleave`: the columns
take turns, one run each a round, so that a shared machine's load falls on all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loadtest.compare import cpu_description
from models.layers import cpu_kernels
from models.layers import quantization as Q


def linear_shapes(name: str) -> tuple[list[tuple[int, int]], int]:
    """(out, in) of one decoder layer's merged linears, and the number of layers."""
    from loadtest.make_gguf import SHAPES, Shape

    s = {**SHAPES, "qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, 1000000.0)}[name]
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    shapes = [
        (qkv, s.hidden_size),
        (s.hidden_size, s.num_heads * s.head_dim),
        (2 * s.intermediate_size, s.hidden_size),
        (s.hidden_size, s.intermediate_size),
    ]
    return shapes, s.num_layers


def best_ms(
    fn: Callable[[], object], repeats: int, stat: str = "best", clock: Callable[[], float] = time.perf_counter
) -> float:
    return interleaved_ms([fn], repeats, stat, clock)[0]


def interleaved_ms(
    fns: list[Callable[[], object]], repeats: int, stat: str = "best", clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Each fn's best or median of `repeats` runs, in ms, the fns taking turns (one warm-up each)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, kept in zip(fns, times):
            start = clock()
            fn()
            kept.append(clock() - start)
    return [(min(t) if stat == "best" else statistics.median(t)) * 1e3 for t in times]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shape", default="smollm2-135m", help="a loadtest.make_gguf shape, or qwen2.5-1.5b")
    p.add_argument("--layers", type=int, default=None, help="default: the shape's")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--stat", choices=("best", "median"), default="best", help="of the repeats: the best or the median")
    p.add_argument("--interleave", action="store_true", help="the columns take turns, a run each a round")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: process CPU time (a busy machine)")
    p.add_argument(
        "--columns",
        nargs="+",
        choices=COLUMNS,
        default=list(COLUMNS),
        help="which products to time (at 1.7B, dense bf16 and torch's kernels take minutes here)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes, num_layers = linear_shapes(args.shape)
    for name in (INT6, *K_QUANTS):
        if any(k % Q.K_GROUP for _, k in shapes) and name in args.columns:
            print(f"{name}: left out, {args.shape}'s inputs are not multiples of {Q.K_GROUP} (a K-quant's block)")
            args.columns.remove(name)
    args.layers = args.layers or num_layers
    if not cpu_kernels.available():
        raise SystemExit("our CPU kernels are not built here (no compiler, or PAGEDSERVE_CPU_KERNELS=0)")
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes] for _ in range(args.layers)]
    # Each column's weights, made one column at a time (at 1.7B the float32 copies alone are 7 GB).
    prepared = {name: [[COLUMNS[name][0](w) for w in ws] for ws in weights] for name in args.columns}
    del weights
    weight_count = sum(n * k for n, k in shapes) * args.layers
    print(
        f"CPU: {cpu_description()}; threads {args.threads}; {args.layers} layers of {args.shape}'s linear "
        f"shapes; {args.stat} of {args.repeats} runs, ms of {args.clock} time (GFLOP/s: 2 x rows x weights / time)"
    )
    print("| rows | " + " | ".join(args.columns) + " |\n|---" + "|---" * len(args.columns) + "|")
    for rows in args.rows:
        x = {k: torch.randn(rows, k, generator=gen) for _, k in shapes}
        xb = {k: v.bfloat16() for k, v in x.items()}

        def product(name: str) -> Callable[[], object]:
            run = COLUMNS[name][1]
            return lambda: [run(w, x, xb) for ws in prepared[name] for w in ws]

        clock = time.perf_counter if args.clock == "wall" else time.process_time
        if args.interleave:
            figures = interleaved_ms([product(name) for name in args.columns], args.repeats, args.stat, clock)
        else:
            figures = [best_ms(product(name), args.repeats, args.stat, clock) for name in args.columns]
        cells = [f"{ms:.2f} ({2 * rows * weight_count / ms / 1e6:.1f})" for ms in figures]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


def _torch_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    q = Q.quantize_int4(w)  # w = s q + m  ->  torch's (q - 8) * s + z with z = m + 8 s
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(Q.unpack_int4(q.qweight, w.shape[1]).int(), 1)
    assert q.mins is not None  # int4 keeps a min per group
    zeros = q.mins + 8 * q.scales
    return packed, torch.stack((q.scales, zeros), -1).transpose(0, 1).contiguous().bfloat16(), w.shape[1]


def _torch_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.abs().amax(1) / 127
    return torch.round(w / s[:, None]).to(torch.int8), s.bfloat16()


def _panels(qw: Q.QuantizedWeight) -> tuple:
    return qw, Q.to_panels(qw)


def _q4_0(w: torch.Tensor) -> tuple:
    """GGUF Q4_0's form, as the 360M and 1.7B files are served: float16 scales, min = -8 x scale."""
    q = Q.quantize_int4(w)
    return _panels(Q.QuantizedWeight(4, q.qweight, q.scales.half(), None, q.in_features))


def _run_q4_0(w: tuple, x: dict) -> torch.Tensor:
    qw, (qweight, scales, _) = w
    return cpu_kernels.quant_linear(x[qw.in_features], qweight, scales, None, None, 4, Q.BLOCK, qw.shape[0], -8.0)


def _q5_0(w: torch.Tensor) -> tuple:
    """GGUF Q5_0's form: float16 scales, min = -16 x scale, not stored."""
    q = Q.quantize_int5(w)
    return _panels(Q.QuantizedWeight(5, q.qweight, q.scales.half(), None, q.in_features))


def _run_q5_0(w: tuple, x: dict) -> torch.Tensor:
    qw, (qweight, scales, _) = w
    return cpu_kernels.quant_linear(x[qw.in_features], qweight, scales, None, None, 5, Q.BLOCK, qw.shape[0], -16.0)


def _q2_k(w: torch.Tensor) -> tuple:
    """GGUF Q2_K's form, from random blocks (no quantizer rounds to it here), d and dmin a weight's size."""
    import numpy as np
    from gguf import GGMLQuantizationType

    from models.gguf import quantized_weight

    n, k = w.shape
    blocks = np.random.default_rng(n * k).integers(0, 256, (n, k // Q.K_GROUP, 84), dtype=np.uint8)
    blocks[..., 80:84] = np.array([2e-3, 2e-3], dtype=np.float16).view(np.uint8)
    return _panels(quantized_weight(blocks.reshape(n, -1), GGMLQuantizationType.Q2_K, n, k))


INT6 = "ours int6 (q6_k)"
K_QUANTS = ("ours q4_k (sub-scales)", "ours q5_k (sub-scales)", "ours q2_k (sub-scales)", "ours iq4_xs (table)")
# name -> (weight (N, K) float32 -> what the product keeps, (kept, x by K, bf16 x by K) -> product)
COLUMNS = {
    "dense f32": (lambda w: w, lambda w, x, xb: F.linear(x[w.shape[1]], w)),
    "dense bf16": (lambda w: w.bfloat16(), lambda w, x, xb: F.linear(xb[w.shape[1]], w)),
    "torch int8 (bf16 act)": (_torch_int8, lambda w, x, xb: torch.ops.aten._weight_int8pack_mm(xb[w[0].shape[1]], *w)),
    "torch int4 g32 (bf16 act)": (
        _torch_int4,
        lambda w, x, xb: torch.ops.aten._weight_int4pack_mm_for_cpu(xb[w[2]], w[0], 32, w[1]),
    ),
    "f32 GEMM, int4 dequantized": (
        lambda w: Q.quantize_int4(w).dequantize(),
        lambda w, x, xb: F.linear(x[w.shape[1]], w),
    ),
    "ours int4 g32": (
        lambda w: _panels(Q.quantize_int4(w)),
        lambda w, x, xb: Q.quantized_linear(x[w[0].in_features], w[0], panels=w[1]),
    ),
    "ours q4_0 (f16 scales)": (_q4_0, lambda w, x, xb: _run_q4_0(w, x)),
    "ours int5 g32": (
        lambda w: _panels(Q.quantize_int5(w)),
        lambda w, x, xb: Q.quantized_linear(x[w[0].in_features], w[0], panels=w[1]),
    ),
    "ours q5_0 (f16 scales)": (_q5_0, lambda w, x, xb: _run_q5_0(w, x)),
    K_QUANTS[0]: (
        lambda w: _panels(Q.quantize_k(w, bits=4)),
        lambda w, x, xb: Q.quantized_linear(x[w[0].in_features], w[0], panels=w[1]),
    ),
    K_QUANTS[1]: (
        lambda w: _panels(Q.quantize_k(w, bits=5)),
        lambda w, x, xb: Q.quantized_linear(x[w[0].in_features], w[0], panels=w[1]),
    ),
    K_QUANTS[2]: (_q2_k, lambda w, x, xb: Q.quantized_linear(x[w[0].in_features], w[0], panels=w[1])),
    "ours iq4_nl (table)": (
        lambda w: _panels(Q.quantize_iq4(w)),
        lambda w, x, xb: Q.quantized_linear(x[w[0].in_features], w[0], panels=w[1]),
    ),
    K_QUANTS[3]: (
        lambda w: _panels(Q.quantize_iq4(w, Q.K_GROUP, sub_scales=True)),
        lambda w, x, xb: Q.quantized_linear(x[w[0].in_features], w[0], panels=w[1]),
    ),
    INT6: (
        lambda w: _panels(Q.quantize_int6(w)),
        lambda w, x, xb: Q.quantized_linear(x[w[0].in_features], w[0], panels=w[1]),
    ),
    "ours int8 g32": (
        lambda w: _panels(Q.quantize_int8(w, 32)),
        lambda w, x, xb: Q.quantized_linear(x[w[0].in_features], w[0], panels=w[1]),
    ),
}

if __name__ == "__main__":
    main()
