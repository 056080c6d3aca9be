"""Weight-only quantized matmuls on this CPU: torch's own kernels against ours, one after the other.

    python -m loadtest.bench_quant [--rows 1 4 16 64] [--threads 2]

30 layers of SmolLM2-135M's linear shapes (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536), random weights, each row count timed as the best of `--repeats` runs (the machine
is shared: the best run is what the code costs). Columns: dense float32 and bfloat16
(F.linear), torch's int8 per-channel and int4 group-32 weight-only kernels (what torchao's CPU
layouts call; fast only with bf16 activations), and ours (models/layers/csrc/quant_linear.cpp,
float32 activations rounded to int16 inside) in int4 and int8, groups of 32.
"""
from __future__ import annotations

import argparse
import time

import torch

from loadtest.compare import cpu_description
from models.layers import cpu_kernels
from models.layers import quantization as Q

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("our CPU kernels are not built here (no compiler, or PAGEDSERVE_CPU_KERNELS=0)")
    gen = torch.Generator().manual_seed(0)
    dense = [[torch.randn(n, k, generator=gen) for n, k in SHAPES] for _ in range(args.layers)]
    int4 = [[Q.quantize_int4(w) for w in ws] for ws in dense]
    int8 = [[Q.quantize_int8(w, 32) for w in ws] for ws in dense]
    bf16 = [[w.bfloat16() for w in ws] for ws in dense]
    torch8 = [[(torch.round(w / (s := w.abs().amax(1) / 127)[:, None]).to(torch.int8), s.bfloat16()) for w in ws]
              for ws in dense]
    torch4 = []
    for ws in dense:
        layer = []
        for w in ws:
            q = Q.quantize_int4(w)  # w = s q + m  ->  torch's (q - 8) * s + z with z = m + 8 s
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(Q.unpack_int4(q.qweight, w.shape[1]).int(), 1)
            zeros = q.mins + 8 * q.scales
            layer.append((packed, torch.stack((q.scales, zeros), -1).transpose(0, 1).contiguous().bfloat16()))
        torch4.append(layer)
    print(f"CPU: {cpu_description()}; threads {args.threads}; {args.layers} layers of SmolLM2-135M's linear shapes; "
          "best of", args.repeats, "runs, ms")
    columns = ["dense f32", "dense bf16", "torch int8 (bf16 act)", "torch int4 g32 (bf16 act)", "ours int4 g32",
               "ours int8 g32"]
    print("| rows | " + " | ".join(columns) + " |\n|---" * 1 + "|---" * len(columns) + "|")
    for rows in args.rows:
        x = {k: torch.randn(rows, k, generator=gen) for _, k in SHAPES}
        xb = {k: v.bfloat16() for k, v in x.items()}
        runs = [
            lambda: [torch.nn.functional.linear(x[w.shape[1]], w) for ws in dense for w in ws],
            lambda: [torch.nn.functional.linear(xb[w.shape[1]], w) for ws in bf16 for w in ws],
            lambda: [torch.ops.aten._weight_int8pack_mm(xb[w.shape[1]], w, s) for ws in torch8 for w, s in ws],
            lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xb[k], p, 32, sz)
                     for ws in torch4 for (p, sz), (_, k) in zip(ws, SHAPES)],
            lambda: [cpu_kernels.quant_linear(x[w.in_features], w.qweight, w.scales, w.mins, None, 4, 32, True)
                     for ws in int4 for w in ws],
            lambda: [cpu_kernels.quant_linear(x[w.in_features], w.qweight, w.scales, None, None, 8, 32, True)
                     for ws in int8 for w in ws],
        ]
        print(f"| {rows} | " + " | ".join(f"{best_ms(run, args.repeats):.2f}" for run in runs) + " |", flush=True)


if __name__ == "__main__":
    main()
