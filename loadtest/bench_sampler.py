"""The sampler on this CPU: our draw op against torch's ops, one after the other in one run.

    python -m loadtest.bench_sampler [--rows 1 4 16] [--threads 2] [--repeats 200]

`engine.sampler.sample` on SmolLM2's vocabulary (49152 logits a row, random normal x 3), seeded rows,
for each sampling setting and row count: with our CPU kernels (cpu_kernels.draw_rows: temperature,
top-k, top-p and min-p in one op; softmax_rows for logprobs) and with torch's ops (what other
devices, or a machine without a compiler, run), the two alternated call by call; the median us per
call of each and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from unittest import mock

import torch

from engine import sampler
from engine.request import SamplingParams
from loadtest.compare import cpu_description
from models.layers import cpu_kernels

VOCAB = 49152
SETTINGS = {
    "t=0.8": SamplingParams(temperature=0.8),
    "t=0.8 top_p=0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "t=0.8 top_k=50 top_p=0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "t=0.8 min_p=0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "t=0.8 logprobs=1": SamplingParams(temperature=0.8, logprobs=1),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_sampler", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("our CPU kernels are not built here (no compiler, or PAGEDSERVE_CPU_KERNELS=0)")
    gen = torch.Generator().manual_seed(0)
    print(f"{cpu_description()}, {args.threads} threads; sample() us per call, median of {args.repeats}")
    print("| setting | rows | ours | torch | ours / torch |")
    print("|---|---|---|---|---|")
    for name, knobs in SETTINGS.items():
        for rows in args.rows:
            logits = torch.randn(rows, VOCAB, generator=gen) * 3
            params = [dataclasses.replace(knobs, seed=i, max_tokens=16) for i in range(rows)]
            generators = [torch.Generator().manual_seed(i) for i in range(rows)]

            def call() -> sampler.SamplerOutput:
                batch = sampler.SamplingBatch.from_params(
                    params, [[1, 2, 3]] * rows, [[4, 5]] * rows, generators, VOCAB, "cpu"
                )
                return sampler.sample(logits, batch)

            times: dict[str, list[float]] = {"ours": [], "torch": []}
            for i in range(args.repeats + 10):
                for path in ("ours", "torch") if i % 2 == 0 else ("torch", "ours"):
                    with mock.patch.object(
                        sampler.cpu_kernels, "usable", cpu_kernels.usable if path == "ours" else (lambda x: False)
                    ):
                        start = time.perf_counter()
                        call()
                        if i >= 10:  # the first calls warm up
                            times[path].append(time.perf_counter() - start)
            ours, theirs = (statistics.median(times[k]) * 1e6 for k in ("ours", "torch"))
            print(f"| {name} | {rows} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
