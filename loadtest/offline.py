"""Offline throughput: our engine vs transformers' continuous batching, one process.

    python -m loadtest.offline --model SmolLM2-135M-Instruct --dtype bfloat16 \
        --num-prompts 64 --input-len 128 --output-len 128

Both engines get the same weights (the checkpoint's, in the same dtype), the
same random token-id prompts and greedy decoding with EOS ignored, so both
produce exactly num_prompts * output_len tokens; the figure is output tokens
per second of wall time, and the ratio is ours / transformers'. Every timed run, and the
warm-up, gets prompts of its own: a repeat of the same prompts would find them in our prefix
cache (transformers' generate_batch keeps none) and skip their prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from models.fetch import DEFAULT_MODEL

if TYPE_CHECKING:
    from transformers import GenerationMixin, PretrainedConfig


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    # Token ids straight from the vocabulary: exact lengths, no tokenizer round trip.
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size - 100, (num, length), generator=gen).tolist()


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int, int]:
    """(seconds, output tokens, prompt tokens the prefix cache held)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(r.token_ids) for r in results), sum(r.num_cached_tokens for r in results)


def load_hf_model(model: str, hf_config: PretrainedConfig, dtype: torch.dtype) -> GenerationMixin:
    """The same weights as ours, as transformers' own model class in the same dtype."""
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    from models.gguf import load_gguf
    from models.fetch import resolve_model_path

    # GGUF: dequantize with our reader (HF tensor names) into transformers' Llama,
    # rather than transformers' GGUF path, which keeps weights packed and dequantizes per matmul.
    _, weights, _, _ = load_gguf(resolve_model_path(model))
    # Built for real, not on meta: its rotary buffers are computed in __init__.
    hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        assert isinstance(tensor, torch.Tensor)  # without keep_quantized every tensor comes dequantized
        state[name] = tensor.to(dtype)
    if "lm_head.weight" not in state:  # tied embeddings
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise ValueError(f"weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
    return hf_model.eval()


def run_hf(hf_model: GenerationMixin, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )  # eos -1: disabled, like our ignore_eos
    start = time.perf_counter()
    # No inference_mode here: generate_batch updates its static tensors in place between calls.
    with torch.no_grad():
        outputs = hf_model.generate_batch(prompts, generation_config=config)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.generated_tokens) for o in outputs.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.offline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint dir, .gguf file or the default alias")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per engine; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV-cache block")
    parser.add_argument("--skip-hf", action="store_true", help="only measure our engine")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=max(args.num_prompts, 1),
        max_num_batched_tokens=max(2048, args.num_prompts),
        block_size=args.block_size,
    )
    config = llm.engine.model_config
    # the warm-up's 2 prompts, then each timed run's num_prompts (the same for both engines)
    drawn = random_prompts(2 + args.repeats * args.num_prompts, args.input_len, config.vocab_size, args.seed)
    warm_up, runs = (
        drawn[:2],
        [drawn[2 + i * args.num_prompts : 2 + (i + 1) * args.num_prompts] for i in range(args.repeats)],
    )
    figures: dict = {
        "model": str(args.model),
        "dtype": str(config.dtype).removeprefix("torch."),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "threads": torch.get_num_threads(),
        "block_size": args.block_size,
    }

    run_ours(llm, warm_up, 4)  # warm-up: first-call allocations and kernel selection
    ours = [run_ours(llm, prompts, args.output_len) for prompts in runs]
    figures["pagedserve_tokens_per_s"] = statistics.median(n / t for t, n, _ in ours)
    figures["pagedserve_cached_prompt_tokens"] = sum(cached for _, _, cached in ours)  # 0: every prefill ran
    _print_row("pagedserve", [(t, n) for t, n, _ in ours])

    if not args.skip_hf:
        hf_model = load_hf_model(args.model, config.hf_config, config.dtype)
        del llm  # free our copy of the weights before transformers runs
        run_hf(hf_model, warm_up, 4)
        theirs = [run_hf(hf_model, prompts, args.output_len) for prompts in runs]
        figures["transformers_tokens_per_s"] = statistics.median(n / t for t, n in theirs)
        figures["ratio"] = figures["pagedserve_tokens_per_s"] / figures["transformers_tokens_per_s"]
        _print_row("transformers generate_batch", theirs)
        print(f"ratio pagedserve / transformers: {figures['ratio']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    return 0


def _print_row(name: str, runs: list[tuple[float, int]]) -> None:
    rates = [n / t for t, n in runs]
    print(
        f"{name:<30} {runs[0][1]:>7} tokens  median {statistics.median(t for t, _ in runs):8.2f} s"
        f"  {statistics.median(rates):9.1f} output tok/s",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
