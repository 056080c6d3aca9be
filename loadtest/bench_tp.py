"""Tensor parallel against one rank, one after the other in this script: the same requests
through the offline engine (engine.llm.LLM) with --tensor-parallel-size 1, then N.

    python -m loadtest.bench_tp --model ~/.cache/pagedserve/synthetic/smollm2-1.7b-q4_0.gguf \\
        [--tensor-parallel-size 2] [--concurrency 1 8] [--prompt-tokens 128] [--max-tokens 32]

Per concurrency: the median time of a decode step (ms per step: all streams advance one
token), from each request's decode time, and the prefill time of the whole batch. Both runs
get the same cores: N ranks share them (threads per rank = cores / N), so on one socket
tensor parallelism adds all-reduces (two per layer) and per-rank fixed costs to a budget of
bandwidth and FLOPs that is the same; it pays where each rank brings its own memory
bandwidth (NUMA nodes, GPUs) or where the model does not fit one rank.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from engine.llm import LLM
from engine.request import SamplingParams


def run(llm: LLM, concurrency: int, prompt_tokens: int, max_tokens: int, repeats: int) -> tuple[float, float]:
    """(median ms per decode step, median ms of the batch's prefill)."""
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    steps, prefills = [], []
    for _ in range(repeats):
        prompts = [[rng.randrange(100, vocab) for _ in range(prompt_tokens)] for _ in range(concurrency)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        decode = statistics.median(r.decode_time for r in results)
        steps.append(decode / (max_tokens - 1) * 1e3)
        prefills.append((wall - decode) * 1e3)
    return statistics.median(steps), statistics.median(prefills)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint dir or .gguf file")
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    results = {}
    for size in (1, args.tensor_parallel_size):
        with LLM(
            args.model,
            dtype=args.dtype,
            tensor_parallel_size=size,
            num_threads=max(1, cores // size),
            max_num_seqs=max(args.concurrency),
        ) as llm:
            run(llm, 1, 16, 4, 1)  # warm-up
            results[size] = {
                c: run(llm, c, args.prompt_tokens, args.max_tokens, args.repeats) for c in args.concurrency
            }
    n = args.tensor_parallel_size
    print(f"{args.model}: {cores} cores; TP=1 {cores} threads, TP={n} {max(1, cores // n)} threads per rank")
    print(
        f"{'streams':>8} {'decode step TP=1':>17} {f'TP={n}':>8} {'ratio':>6} {'prefill TP=1':>13} "
        f"{f'TP={n}':>8} {'ratio':>6}"
    )
    for c in args.concurrency:
        (s1, p1), (sn, pn) = results[1][c], results[n][c]
        print(f"{c:>8} {s1:>14.1f} ms {sn:>5.1f} ms {sn / s1:>5.2f}x {p1:>10.0f} ms {pn:>5.0f} ms {pn / p1:>5.2f}x")


if __name__ == "__main__":
    main()
