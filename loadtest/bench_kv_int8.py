"""Decode over a long context with the KV cache in float32, bfloat16, float16 and int8, interleaved.

    python -m loadtest.bench_kv_int8 [--context 4000] [--batch 1 8] [--threads 2] [--clock wall]
    python -m loadtest.bench_kv_int8 --models SmolLM2-135M-Instruct qwen2.5-coder-1.5b-instruct-q4_k_m

For each model (a GGUF as served: float32 activations, weights as `--quantization auto` keeps
them) and each batch of decodes at `--context` tokens each, two timings per cache dtype:

    attention   one step's paged attention over every layer (K/V write included), each layer's
                queries and keys random, its cache its own tensor: what a decode reads of the cache
    step        the model's forward of the batch's decode rows and the logits of those rows

The caches hold random keys and values (an int8 cache's rows quantized as the server writes
them), the sequences' blocks scattered over the pool. Each round times every dtype once, in an
order that rotates round by round; the figures are medians over rounds, and each ratio the
median of the rounds' ratios against bfloat16. Each model's header gives the bytes a token takes
in every layer and the tokens a GiB of cache holds in int8 against bfloat16 and float32 (an int8
row's scale counted).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from loadtest.bench_step import BLOCK_SIZE, Batch
from loadtest.compare import cpu_description
from models.causal_lm import CausalLM
from models.layers import cpu_kernels
from models.kv_int8 import calibrate_int8_keys
from models.layers.attention import KV_SCALE_BYTES, AttentionMetadata, paged_attention, quantize_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def fill_random(cache: torch.Tensor, gen: torch.Generator) -> None:
    """Random keys and values in every row of `cache`; an int8 cache's rows quantized with their scales."""
    if cache.dtype == torch.int8:
        rows = cache.view(-1, cache.shape[-1])  # (rows, D + 2): a row's bytes are contiguous in every layout
        chunk = 1 << 16
        for start in range(0, rows.shape[0], chunk):
            n = min(chunk, rows.shape[0] - start)
            rows[start : start + n] = quantize_rows(torch.randn(n, cache.shape[-1] - KV_SCALE_BYTES, generator=gen))
    else:
        cache.copy_(torch.randn(cache.shape, generator=gen))


def attention_step(
    heads: int, entry_shape: tuple[int, ...], caches: list[torch.Tensor], batch: Batch, gen: torch.Generator
) -> Callable:
    """One step's paged attention over every layer: the model's head counts, random q/k/v."""
    _, kv_heads, head_dim = entry_shape
    n = len(batch.seq_lens)
    meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.block_tables, BLOCK_SIZE)
    q = torch.randn(n, heads, head_dim, generator=gen)  # (num_tokens, num_heads, head_dim)
    k, v = torch.randn(2, n, kv_heads, head_dim, generator=gen)  # (num_tokens, num_kv_heads, head_dim)

    def run() -> None:
        for cache in caches:
            paged_attention(q, k, v, cache, meta, head_dim**-0.5)

    return run


def decode_step(model: CausalLM, caches: list[torch.Tensor], batch: Batch) -> Callable:
    meta = batch.build()

    def run() -> torch.Tensor:
        hidden = model(batch.input_ids, batch.positions, caches, meta)
        return model.compute_logits(hidden)

    return run


def timed(fn: Callable[[], object], clock: Callable[[], float], calls: int) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def bench_model(name: str, args: argparse.Namespace, clock: Callable[[], float]) -> None:
    from engine.model_runner import resolve_kv_cache_dtype
    from models.loader import load_model

    loaded = load_model(name, dtype="float32", quantization="auto")
    calibrate_int8_keys(loaded)  # the int8 step's keys and queries as the server makes them
    model = loaded.model
    specs = {d: model.kv_cache_spec(DTYPES[d]) for d in DTYPES}
    heads, (_, kv_heads, head_dim) = loaded.config.hf_config.num_attention_heads, specs["float32"].entry_shape
    print(
        f"\n{name}: {specs['float32'].num_layers} layers, {heads} query / {kv_heads} KV heads x {head_dim}, "
        f"weights {loaded.quantization}, "
        f"float32 activations (the server's default KV cache here: {resolve_kv_cache_dtype('auto', loaded)})"
    )
    per_gib = {d: 2**30 // s.bytes_per_token for d, s in specs.items()}
    print(
        "KV bytes a token: "
        + ", ".join(f"{d} {s.bytes_per_token}" for d, s in specs.items())
        + f"; tokens a GiB holds, int8 / bfloat16: {per_gib['int8'] / per_gib['bfloat16']:.3f}x, "
        f"int8 / float32: {per_gib['int8'] / per_gib['float32']:.3f}x"
    )
    print("| batch x context | dtype | attention ms | step ms | attention / bf16 | step / bf16 |")
    print("|---|---|---|---|---|---|")
    for batch_size in args.batch:
        num_blocks = batch_size * -(-(args.context + 1) // BLOCK_SIZE) + 1
        batch = Batch([1] * batch_size, [args.context + 1] * batch_size, num_blocks, "cpu", seed=batch_size)
        gen = torch.Generator().manual_seed(0)
        runs: dict[str, tuple[Callable, Callable]] = {}
        caches_by_dtype = {}
        for d, spec in specs.items():
            caches = spec.allocate(num_blocks, BLOCK_SIZE, "cpu")
            for cache in caches:
                fill_random(cache, gen)
            caches_by_dtype[d] = caches
            runs[d] = (attention_step(heads, spec.entry_shape, caches, batch, gen), decode_step(model, caches, batch))
        times: dict[str, list[tuple[float, float]]] = {d: [] for d in DTYPES}
        order = list(DTYPES)
        with torch.inference_mode():
            for attend, step in runs.values():  # warm up: first-touch pages, thread team, kernel caches
                attend(), step()
            for r in range(args.rounds):
                for d in order[r % len(order) :] + order[: r % len(order)]:
                    attend, step = runs[d]
                    times[d].append((timed(attend, clock, args.calls), timed(step, clock, args.calls)))
        del caches_by_dtype
        base = times["bfloat16"]
        for d in DTYPES:
            att = statistics.median(t[0] for t in times[d]) * 1e3
            stp = statistics.median(t[1] for t in times[d]) * 1e3
            att_ratio = statistics.median(t[0] / b[0] for t, b in zip(times[d], base))
            stp_ratio = statistics.median(t[1] / b[1] for t, b in zip(times[d], base))
            print(
                f"| {batch_size} x {args.context} | {d} | {att:.3f} | {stp:.2f} | {att_ratio:.3f} | {stp_ratio:.3f} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_kv_int8",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", nargs="+", default=["SmolLM2-135M-Instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m"])
    p.add_argument("--context", type=int, default=4000, help="tokens cached before each decode")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decodes a step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=3, help="calls timed together in each round")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: process CPU time")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("our CPU kernels are not built here (no compiler, or PAGEDSERVE_CPU_KERNELS=0)")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"{cpu_description()}; kernels {cpu_kernels.loaded_target()}, {args.threads} threads, {args.clock} clock, "
        f"{args.rounds} rounds of {args.calls} calls; load average {os.getloadavg()[0]:.2f}"
    )
    random.seed(0)
    for name in args.models:
        bench_model(name, args, clock)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
