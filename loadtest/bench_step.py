"""Per-phase timings of one model step, without the engine around it.

    python -m loadtest.bench_step [--model SmolLM2-135M-Instruct] [--dtype auto] [--threads 2]

Phases: AttentionMetadata.build for 64 decodes, forward passes for batches of
1/16/64 decodes (contexts 128-256), for one request's speculative verification
(1, 2, 4, 6 rows after 200 tokens), for one 128-token prefill and for a mixed
step as the scheduler makes them under load (32 decodes, 14 fresh 128-token
prompts, one 128-token chunk after 128 cached tokens), and compute_logits for
1, 4 and 64 rows.  Each phase is repeated and reported as median and p10 (the
machine is shared: p10 is what the code costs when nobody else holds the cores,
the median what it costs today).

On a busy machine, `--threads 1 --clock cpu` measures this process's CPU time,
which other processes' load does not inflate (with 2 threads, one descheduled
thread stalls the other at every parallel region, and wall time swings 5x).

The baseline column is the time of the same phase's matmuls alone (every
linear layer of the forward, as the model runs it, with the phase's row count),
so `x base` says how much of a phase is overhead around the arithmetic.

`--profile` adds, under each forward phase, its ops by the calling thread's time
in them (torch.profiler over a few more forwards; per forward, with the share and
calls): run at 1 and at N threads, an op whose time does not fall with the
threads is what keeps a step from scaling (Amdahl). The profiler adds ~1-2 us a
call, so small ops read high.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

import torch

from models.causal_lm import CausalLM
from models.layers.attention import AttentionMetadata
from models.layers.linear import Embedding, Linear
from models.layers.quantization import QUANTIZATIONS

BLOCK_SIZE = 16


def timeit(
    fn: Callable[[], object], repeats: int, warmup: int = 3, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """(median, p10) seconds of `fn()` over `repeats` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    times.sort()
    return statistics.median(times), times[len(times) // 10]


class Batch:
    """Decodes (or one prefill) over random contexts in a paged cache, as the runner would build them."""

    def __init__(
        self, query_lens: list[int], seq_lens: list[int], num_blocks: int, device: torch.device | str, seed: int = 0
    ):
        rng = random.Random(seed)
        free = list(range(num_blocks))
        rng.shuffle(free)  # scattered blocks, like a cache that has been in use for a while
        self.block_tables: list[list[int]] = []
        for s in seq_lens:
            need = (s + BLOCK_SIZE - 1) // BLOCK_SIZE
            self.block_tables.append([free.pop() for _ in range(need)])
        self.query_lens, self.seq_lens, self.device = query_lens, seq_lens, device
        positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
        self.positions = torch.tensor(positions, dtype=torch.int64, device=device)
        self.input_ids = torch.randint(100, 10_000, (len(positions),), generator=torch.Generator().manual_seed(seed))
        self.input_ids = self.input_ids.to(device)

    def build(self) -> AttentionMetadata:
        return AttentionMetadata.build(self.query_lens, self.seq_lens, self.block_tables, BLOCK_SIZE, self.device)


def linear_layers(model: CausalLM) -> list[Linear]:
    """Every linear layer the forward runs, in order (the embedding and logits excluded)."""
    return [m for m in model.model.modules() if isinstance(m, Linear) and not isinstance(m, Embedding)]


def op_profile(fn: Callable[[], object], runs: int, top: int = 12) -> str:
    """The `top` ops of `runs` calls of fn by self time on the calling thread, per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return "\n".join(
        f"    {e.key:<40}{e.self_cpu_time_total / 1e3 / runs:>10.3f} ms{100 * e.self_cpu_time_total / total:>7.1f}%"
        f"{e.count / runs:>8.0f} calls"
        for e in events[:top]
    )


def matmul_baseline(
    linears: list[Linear], rows: int, repeats: int, clock: Callable[[], float], dtype: torch.dtype, device: torch.device
) -> tuple[float, float]:
    """Time of multiplying `rows` rows by each of `linears`, as their methods do."""
    x_by_in = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype, device=device) for m in linears}

    def run() -> None:
        for m in linears:
            m.linear(x_by_in[m.in_features])

    return timeit(run, repeats, clock=clock)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    # auto: what `python -m server` runs (float32 activations for GGUF files on CPUs); bfloat16 here
    # used to be the default, which timed a path the server does not take for them.
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    parser.add_argument(
        "--batch-invariant", action="store_true", help="dense layers on RowsDenseMethod (the server's flag)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (0 = leave as is)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: process CPU time")
    parser.add_argument("--phases", default="all", help="comma list of: build,decode,verify,prefill,mixed,logits")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="under each forward phase, its ops by time (torch.profiler, a few more forwards)",
    )
    parser.add_argument("--top", type=int, default=12, help="with --profile: how many ops a phase lists")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    from models.loader import load_model  # after set_num_threads: loading spins up the thread pool

    loaded = load_model(
        args.model, dtype=args.dtype, quantization=args.quantization, batch_invariant=args.batch_invariant
    )
    model, device = loaded.model, next(loaded.model.parameters()).device
    phases = (
        set(args.phases.split(","))
        if args.phases != "all"
        else {"build", "decode", "verify", "prefill", "mixed", "logits"}
    )
    rng = random.Random(0)
    max_seqs, max_len = 64, 257
    num_blocks = max_seqs * ((max_len + BLOCK_SIZE - 1) // BLOCK_SIZE) + 1
    from engine.model_runner import resolve_kv_cache_dtype

    cache_dtype = resolve_kv_cache_dtype("auto", loaded)  # the engine's: float16 under float32 + quantized
    kv_caches = model.kv_cache_spec(cache_dtype).allocate(num_blocks, BLOCK_SIZE, device)
    for cache in kv_caches:
        cache.normal_()  # real-looking values: zeros could take faster paths in exp/softmax
    weights = linear_layers(model)
    logits_layer = model.model.embed_tokens if model.lm_head is None else model.lm_head
    dtype = loaded.config.dtype

    def baseline(linears: list[Linear], rows: int, repeats: int) -> tuple[float, float]:
        return matmul_baseline(linears, rows, repeats, clock, dtype, device)

    print(
        f"model {args.model} {loaded.config.dtype} weights {loaded.quantization}, KV cache {cache_dtype}, threads {torch.get_num_threads()}, repeats {args.repeats}, "
        f"{args.clock} clock"
    )
    print(f"{'phase':<34}{'median ms':>10}{'p10 ms':>9}{'base ms':>9}{'x base':>8}")

    def report(
        name: str,
        timing: tuple[float, float],
        base: tuple[float, float] | None = None,
        forward: Callable[[], object] | None = None,
        runs: int = 3,
    ) -> None:
        med, p10 = timing
        cols = f"{name:<34}{med * 1e3:>10.2f}{p10 * 1e3:>9.2f}"
        if base is not None:
            cols += f"{base[0] * 1e3:>9.2f}{med / base[0]:>8.2f}"
        print(cols, flush=True)
        if args.profile and forward is not None:
            print(op_profile(forward, runs, args.top), flush=True)

    def decode_batch(n: int) -> Batch:
        return Batch([1] * n, [rng.randint(128, 256) for _ in range(n)], num_blocks, device, seed=n)

    with torch.inference_mode():
        if "build" in phases:
            for n in (1, 64):
                batch = decode_batch(n)
                report(f"AttentionMetadata.build decode b{n}", timeit(batch.build, args.repeats * 10, clock=clock))
        if "decode" in phases:
            for n in (1, 16, 64):
                batch = decode_batch(n)
                meta = batch.build()
                forward = lambda: model(batch.input_ids, batch.positions, kv_caches, meta)  # noqa: E731
                fwd = timeit(forward, args.repeats, 3, clock)
                report(f"forward decode b{n} ctx128-256", fwd, baseline(weights, n, args.repeats), forward, 10)
        if "verify" in phases:  # one request's speculative step: its token and k drafts, k+1 rows
            for rows in (1, 2, 3, 4, 5, 6, 8):
                batch = Batch([rows], [200], num_blocks, device, seed=3)
                meta = batch.build()
                forward = lambda: model(batch.input_ids, batch.positions, kv_caches, meta)  # noqa: E731
                fwd = timeit(forward, args.repeats, 3, clock)
                report(
                    f"forward 1 request, {rows} rows ctx200", fwd, baseline(weights, rows, args.repeats), forward, 10
                )
        if "prefill" in phases:
            batch = Batch([128], [128], num_blocks, device)
            meta = batch.build()
            repeats = max(5, args.repeats // 3)
            forward = lambda: model(batch.input_ids, batch.positions, kv_caches, meta)  # noqa: E731
            fwd = timeit(forward, repeats, clock=clock)
            report("forward prefill 128 tokens", fwd, baseline(weights, 128, repeats), forward)
        if "mixed" in phases:
            query_lens = [1] * 32 + [128] * 15
            seq_lens = [rng.randint(128, 256) for _ in range(32)] + [128] * 14 + [256]
            batch = Batch(query_lens, seq_lens, num_blocks, device, seed=2)
            meta = batch.build()
            repeats = max(3, args.repeats // 5)
            forward = lambda: model(batch.input_ids, batch.positions, kv_caches, meta)  # noqa: E731
            fwd = timeit(forward, repeats, 1, clock)
            report(
                f"forward mixed step {sum(query_lens)} tokens",
                fwd,
                baseline(weights, sum(query_lens), repeats),
                forward,
                1,
            )
        if "logits" in phases:
            for n in (1, 4, 64):
                hidden = torch.randn(n, logits_layer.in_features, dtype=dtype, device=device)
                report(
                    f"compute_logits {n} rows",
                    timeit(lambda: model.compute_logits(hidden), args.repeats, clock=clock),
                    baseline([logits_layer], n, args.repeats),
                )


if __name__ == "__main__":
    main()
