"""Paged attention on this CPU, per layer: a prompt, a chunk after cached tokens, a batch of decodes.

    python -m loadtest.bench_attention [--tokens 512] [--threads 2] [--clock cpu] [--pytorch]
                                       [--decodes 64] [--kv-dtype float32] [--layers 1]

SmolLM2's attention shapes (135M: 9 query / 3 KV heads, 360M: 15 / 5, 1.7B: 32 / 32, head dim
64), random keys and values in a float32 cache of 16-token blocks, each case timed as the best
of `--repeats` runs of `models.layers.attention.paged_attention` (K/V write included). Cases:
one fresh prompt of `--tokens` tokens; the second half of that prompt as a chunk after its
first half, cached; `--decodes` decodes of 128-256 cached tokens. `--kv-dtype float16` holds the
cache as a 16-bit model's; `--layers N` gives each case N caches of its own, run in turn and timed
per layer, so that a decode's keys come from memory as they do in a forward (one cache of a few MB
stays in the last-level cache from one run to the next). For scale, `linear` is the same
layer's float32 projections (qkv, o, gate_up, down) for the prompt's rows. `--pytorch` runs
the eager paths (what serves without our kernels) instead of the C++ kernel. On a shared machine
`--threads 1 --clock cpu` measures this process's CPU time, which other processes' load inflates
far less than wall time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loadtest.compare import cpu_description
from models.layers import cpu_kernels
from models.layers.attention import AttentionMetadata, paged_attention

# name -> (query heads, KV heads, head dim, hidden size, intermediate size)
SHAPES = {
    "135M": (9, 3, 64, 576, 1536),
    "360M": (15, 5, 64, 960, 2560),
    "1.7B": (32, 32, 64, 2048, 8192),
}
BLOCK_SIZE = 16


def best_ms(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        for _ in range(5):  # CPU clocks tick coarsely: time a few calls together
            fn()
        times.append((clock() - start) / 5)
    return min(times) * 1e3


def attention_case(
    shape: tuple[int, ...],
    query_lens: list[int],
    seq_lens: list[int],
    gen: torch.Generator,
    kv_dtype: torch.dtype = torch.float32,
    layers: int = 1,
) -> Callable[[], list[torch.Tensor]]:
    """A closure running one step's paged_attention on each of `layers` caches: sequence i has
    query_lens[i] new tokens at the end of its seq_lens[i]; its earlier tokens sit in the cache already."""
    num_heads, num_kv_heads, head_dim = shape[:3]
    tables: list[list[int]] = []
    next_block = 0
    for n in seq_lens:
        used = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + used)))
        next_block += used
    caches = [
        torch.randn(next_block, BLOCK_SIZE, 2, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
        for _ in range(layers)
    ]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    tokens = sum(query_lens)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen)
    k, v = torch.randn(2, tokens, num_kv_heads, head_dim, generator=gen)
    return lambda: [paged_attention(q, k, v, cache, meta, head_dim**-0.5) for cache in caches]


def linear_case(
    shape: tuple[int, int, int, int, int], tokens: int, gen: torch.Generator
) -> Callable[[], list[torch.Tensor]]:
    num_heads, num_kv_heads, head_dim, hidden, inter = shape
    weights = [
        torch.randn(n, k, generator=gen) * 0.02
        for n, k in (
            ((num_heads + 2 * num_kv_heads) * head_dim, hidden),
            (hidden, num_heads * head_dim),
            (2 * inter, hidden),
            (hidden, inter),
        )
    ]
    xs = [torch.randn(tokens, w.shape[1], generator=gen) for w in weights]
    return lambda: [F.linear(x, w) for x, w in zip(xs, weights)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: process CPU time")
    p.add_argument("--pytorch", action="store_true", help="the eager PyTorch paths, not our kernel")
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--kv-dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--layers", type=int, default=1, help="caches a case runs on in turn (timed per layer)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.pytorch:
        cpu_kernels.available = lambda: False  # this process only
    elif not cpu_kernels.available():
        raise SystemExit("our CPU kernels are not built here (no compiler, or PAGEDSERVE_CPU_KERNELS=0)")
    gen = torch.Generator().manual_seed(0)
    n, half = args.tokens, args.tokens // 2
    decode_lens = torch.randint(128, 257, (args.decodes,), generator=gen).tolist()
    kv_dtype, layers = getattr(torch, args.kv_dtype), args.layers
    print(
        f"{cpu_description()}, {args.threads} threads, {'eager PyTorch' if args.pytorch else 'C++ kernel'}; "
        f"ms per layer, best of {args.repeats} ({args.clock} clock); {args.kv_dtype} cache, {layers} layer(s)"
    )
    print(f"| shape | prompt {n} | chunk {n - half} after {half} | {args.decodes} decodes | linear, {n} rows |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for name, shape in SHAPES.items():
            cases = [
                attention_case(shape, [n], [n], gen, kv_dtype, layers),
                attention_case(shape, [n - half], [n], gen, kv_dtype, layers),
                attention_case(shape, [1] * args.decodes, decode_lens, gen, kv_dtype, layers),
            ]
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            times = [best_ms(case, args.repeats, clock) / layers for case in cases]
            times.append(best_ms(linear_case(shape, n, gen), args.repeats, clock))
            print(f"| {name} ({shape[0]}/{shape[1]} x {shape[2]}) | " + " | ".join(f"{t:.2f}" for t in times) + " |")


if __name__ == "__main__":
    main()
