"""Time to first token of a long prompt computed cold, against the same prompt after a restart with
its prefix in the prefix cache's disk tier (engine/kv_disk.py), interleaved.

    python -m loadtest.bench_kv_disk [--tokens 4000] [--rounds 3] [--layers 28] [--threads 2]
    python -m loadtest.bench_kv_disk --model qwen2.5-coder-1.5b-instruct-q4_k_m

Default model: a random-weight GGUF (loadtest/make_gguf.py, Q4_0 linears, SmolLM2's tokenizer) of
Qwen2.5-1.5B's shape: hidden 1536, intermediate 8960, 12 heads and 2 KV heads of 128, 28 layers
(`--layers` fewer for a quick look). Served as the server serves a GGUF: float32 activations,
weights as stored, the KV cache in float16. Each round takes a fresh prompt of random token ids:

    engine A (disk tier on, nothing on disk for this prompt)  cold prefill, TTFT timed; closed:
                                                               its blocks written to the directory
    engine B (a new engine on the same directory: a restart)  the same prompt, TTFT timed

Each engine serves a two-token request first, as the server's warm-up does. The weights are loaded
once and shared by the engines (a restart reloads them; that is not part of a request's TTFT). Before
the restart the tier's files are synced and dropped from the kernel's page cache
(`posix_fadvise(DONTNEED)`), so engine B reads them from the disk, as a server restarted after its
files have aged out of memory would; `--page-cache` keeps them there instead. Medians over rounds,
and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core import EngineCore
    from models.loader import LoadedModel

QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2)


def random_gguf(layers: int) -> Path:
    """Qwen2.5-1.5B's shape with `layers` layers, random Q4_0 weights, made once and kept in the cache."""
    from loadtest import make_gguf

    name = f"qwen2.5-1.5b-{layers}l"
    shape = {**QWEN_1_5B, "num_layers": layers}
    make_gguf.SHAPES.setdefault(name, make_gguf.Shape(rope_theta=1000000.0, **shape))
    return make_gguf.ensure_gguf(name, "q4_0")


def ttft(core: EngineCore, request_id: str, prompt: list[int]) -> float:
    """Seconds from adding a greedy request to the step that gives its first token."""
    from engine.request import SamplingParams

    start = time.perf_counter()
    core.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    first = None
    while core.has_unfinished:
        for output in core.step():
            if first is None and output.token_ids:
                first = time.perf_counter() - start
    assert first is not None
    return first


def drop_from_page_cache(directory: str) -> int:
    """Write back and evict every file under `directory` from the page cache; returns the bytes dropped."""
    os.sync()
    dropped = 0
    for path in Path(directory).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return dropped


def engine(loaded: LoadedModel, directory: str, num_blocks: int, threads: int) -> EngineCore:
    from engine.config import EngineConfig
    from engine.core import EngineCore

    core = EngineCore(loaded, EngineConfig(num_kv_blocks=num_blocks, num_threads=threads, kv_cache_disk=directory))
    ttft(core, "warm-up", [1, 2])
    return core


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_kv_disk", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model to serve instead of the random 1.5B-shape GGUF")
    p.add_argument("--layers", type=int, default=QWEN_1_5B["num_layers"], help="layers of the random model")
    p.add_argument("--tokens", type=int, default=4000, help="prompt length")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=None, help="the disk tier's parent directory (default: a temporary one)")
    p.add_argument("--page-cache", action="store_true", help="leave the tier's files in the page cache for the restart")
    args = p.parse_args(argv)

    import torch

    from engine.kv_disk import DiskTierStats
    from loadtest.compare import cpu_description
    from models.loader import load_model

    torch.set_num_threads(args.threads)
    model = args.model or str(random_gguf(args.layers))
    loaded = load_model(model, dtype="float32")
    vocab = loaded.config.vocab_size
    num_blocks = -(-(args.tokens + 16) // 16) + 4
    print(
        f"CPU: {cpu_description()}; {args.threads} threads; load {os.getloadavg()[0]:.1f}; model {Path(model).name}; "
        f"prompt {args.tokens} tokens, {args.rounds} rounds; files read "
        f"{'from the page cache' if args.page_cache else 'from the disk (dropped from the page cache)'}"
    )
    cold, warm, ratios = [], [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as parent:
        for r in range(args.rounds):
            directory = os.path.join(parent, f"round-{r}")
            rng = random.Random(r)
            prompt = [rng.randrange(3, vocab) for _ in range(args.tokens)]
            first = engine(loaded, directory, num_blocks, args.threads)
            cold.append(ttft(first, "cold", prompt))
            start = time.perf_counter()
            first.close()
            written = time.perf_counter() - start
            dropped = 0 if args.page_cache else drop_from_page_cache(directory)
            second = engine(loaded, directory, num_blocks, args.threads)
            warm.append(ttft(second, "warm", prompt))
            stats = second.stats()
            second.close()
            ratios.append(warm[-1] / cold[-1])
            disk = stats.kv_disk
            assert isinstance(disk, DiskTierStats)
            print(
                f"round {r}: cold {cold[-1]:.3f} s, after restart {warm[-1]:.3f} s (ratio {ratios[-1]:.4f}); "
                f"{stats.prefix_cache_disk_hits} tokens from disk, {disk.bytes_read / 2**20:.1f} MiB read in "
                f"{disk.read_seconds:.3f} s ({dropped / 2**20:.1f} MiB dropped from the page cache before); "
                f"shutdown wrote for {written:.2f} s; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    print(
        f"median TTFT: cold {statistics.median(cold):.3f} s, after restart {statistics.median(warm):.3f} s; "
        f"ratio of medians {statistics.median(warm) / statistics.median(cold):.4f}, "
        f"median ratio {statistics.median(ratios):.4f}"
    )


if __name__ == "__main__":
    main()
