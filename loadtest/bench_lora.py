"""Decode steps with LoRA adapters against the same steps on the base model, interleaved in one run.

    python -m loadtest.bench_lora [--model smollm2-135m:q4_0] [--streams 1 16] [--adapters 4] [--rank 16]
                                  [--targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]
                                  [--lora-dtype auto [bfloat16 ...]] [--threads 2] [--clock wall]
                                  [--rounds 5] [--repeats 5]

The model is built once (a path, a model name, or a loadtest.make_gguf shape such as
`smollm2-1.7b:q4_0`, written on first use), as `python -m server` loads it. `--adapters` random
adapters of rank `--rank` on `--targets` are prepared and installed through the API the server's
runner uses (models/layers/lora.py prepare_lora_adapter, PreparedLoRA.install), in each
`--lora-dtype` (the server's flag; auto: the model's dtype), a set of slots per dtype.

One step is what the runner does for a batch of decodes: LoRABatch.build (adapter steps only),
AttentionMetadata.build, the forward and the logits of every row. For each `--streams` count,
the base step and the adapter step (row i under adapter i mod N) of each dtype take turns: each
round times `--repeats` of one, then of the next, and keeps each median. The machine may be
shared, so a round's ratio compares runs seconds apart, and the report is the median over rounds:

    b16 base      median ms, tok/s
    b16 lora      median ms, tok/s               (several dtypes: b16 lora:bfloat16 ...)
    b16 ratio     tok/s lora / base  (and per-token latency lora / base)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from engine.config import LORA_DTYPES
from loadtest.bench_step import BLOCK_SIZE, Batch, timeit
from models.layers.linear import Embedding, Linear, MergedLinear
from models.layers.lora import TARGET_MODULES, LoRAAdapter, prepare_lora_adapter
from models.layers.lora_weights import LoRABatch
from models.layers.quantization import QUANTIZATIONS

ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def random_adapter(model: nn.Module, name: str, rank: int, targets: set[str], seed: int) -> LoRAAdapter:
    """A rank-`rank` adapter on every layer of `targets`, its (A, B) keyed by HF module path as a
    PEFT file's are, with random values (B not zero, as a trained adapter's)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for path, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = path.rpartition(".")[0]
            shards = [(f"{parent}.{s}", module.checkpoint_shard_sizes[s]) for s in module.shard_sizes]
        elif isinstance(module, Linear) and not isinstance(module, Embedding):
            shards = [(path, module.checkpoint_out_features)]
        else:
            continue
        for module_path, out in shards:
            if module_path.rpartition(".")[2] in targets and ".experts." not in module_path:
                a = torch.randn(rank, module.checkpoint_in_features, generator=gen) / module.checkpoint_in_features**0.5
                weights[module_path] = (a, torch.randn(out, rank, generator=gen) * 0.01)
    if not weights:
        raise SystemExit(f"the model has no layer among --targets {sorted(targets)}")
    return LoRAAdapter(name, f"<random seed {seed}>", rank, 2.0, weights)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_lora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m:q4_0",
        help="a path, a model name, or a loadtest.make_gguf shape:type (written on first use)",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16], help="decode rows per step")
    parser.add_argument("--adapters", type=int, default=4, help="adapters the rows are spread over")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=ALL_LINEAR, help=f"comma list of: {','.join(TARGET_MODULES)}")
    parser.add_argument(
        "--lora-dtype",
        nargs="+",
        default=["auto"],
        choices=LORA_DTYPES,
        help="the adapters' dtype (the server's --lora-dtype); several: each timed against the same base steps",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (0 = leave as is)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved base / adapter rounds")
    parser.add_argument("--repeats", type=int, default=5, help="steps timed per round and side")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: process CPU time")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock: Callable[[], float] = time.perf_counter if args.clock == "wall" else time.process_time
    from engine.model_runner import resolve_kv_cache_dtype
    from loadtest.make_gguf import ensure_gguf, parse_shortcut
    from models.loader import load_model  # after set_num_threads: loading spins up the thread pool

    shortcut = parse_shortcut(args.model)
    loaded = load_model(
        str(ensure_gguf(*shortcut)) if shortcut else args.model, dtype=args.dtype, quantization=args.quantization
    )
    model, device = loaded.model, next(loaded.model.parameters()).device
    targets = set(args.targets.split(","))
    names = list(dict.fromkeys(args.lora_dtype))
    for d, name in enumerate(names):  # as engine/model_runner.py resolves --lora-dtype
        dtype = loaded.config.dtype if name == "auto" else getattr(torch, name)
        for n in range(args.adapters):  # the same adapters in each dtype, slots of their own
            adapter = random_adapter(model, f"a{n}", args.rank, targets, seed=n)
            prepare_lora_adapter(model, adapter, dtype).install(1 + d * args.adapters + n)
    max_seqs, max_len = max(args.streams), 257
    num_blocks = max_seqs * ((max_len + BLOCK_SIZE - 1) // BLOCK_SIZE) + 1
    kv_caches = model.kv_cache_spec(resolve_kv_cache_dtype("auto", loaded)).allocate(num_blocks, BLOCK_SIZE, device)
    for cache in kv_caches:
        cache.normal_()
    print(
        f"model {args.model} {loaded.config.dtype} weights {loaded.quantization}, threads {torch.get_num_threads()}, "
        f"{args.adapters} adapters rank {args.rank} on {args.targets} in {' '.join(names)}, "
        f"{args.rounds} rounds x {args.repeats} steps, "
        f"{args.clock} clock, load average {_load()}"
    )
    width = 14 if len(names) == 1 else 22  # the step column: "b16 ratio:bfloat16"
    print(f"{'step':<{width}}{'median ms':>10}{'tok/s':>9}{'lora/base tok/s':>17}{'lora/base ms':>14}")
    rng = random.Random(0)
    with torch.inference_mode():
        for n in args.streams:
            batch = Batch([1] * n, [rng.randint(128, 256) for _ in range(n)], num_blocks, device, seed=n)

            def step(first_slot: int | None) -> torch.Tensor:
                """One decode step: the base model's (None), or row i under slot first_slot + i mod N."""
                meta = batch.build()
                if first_slot is not None:
                    slots = [first_slot + i % args.adapters if args.adapters else 0 for i in range(n)]
                    lora = LoRABatch.build(batch.query_lens, slots, device)
                    meta = replace(meta, kernels=replace(meta.kernels, lora=lora))
                return model.compute_logits(model(batch.input_ids, batch.positions, kv_caches, meta), meta.kernels)

            base_ms: list[float] = []
            lora_ms: list[list[float]] = [[] for _ in names]
            ratios: list[list[float]] = [[] for _ in names]
            for _ in range(args.rounds):
                base = timeit(lambda: step(None), args.repeats, 1, clock)[0]
                base_ms.append(base * 1e3)
                for d in range(len(names)):
                    lora = timeit(lambda: step(1 + d * args.adapters), args.repeats, 1, clock)[0]
                    lora_ms[d].append(lora * 1e3)
                    ratios[d].append(lora / base)
            base = statistics.median(base_ms)
            print(f"{f'b{n} base':<{width}}{base:>10.2f}{n * 1e3 / base:>9.1f}")
            for d, name in enumerate(names):
                tag = "" if len(names) == 1 else f":{name}"
                lora, ratio = statistics.median(lora_ms[d]), statistics.median(ratios[d])
                print(f"{f'b{n} lora{tag}':<{width}}{lora:>10.2f}{n * 1e3 / lora:>9.1f}")
                print(f"{f'b{n} ratio{tag}':<{width}}{'':>19}{1 / ratio:>17.3f}{ratio:>14.3f}", flush=True)
    print(f"load average {_load()}")


def _load() -> str:
    """The 1, 5 and 15 minute load averages (what `uptime` prints): the figures' context on a shared machine."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
