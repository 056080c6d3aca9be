"""KV memory of sliding-window models in the paged cache, as served: one request's prompt run
through the engine (random weights, the attention shapes of a real model, a small hidden size so
that the run is quick), the blocks its KV cache groups hold when the prompt is done, against one
block table for every layer (what a cache without groups holds).

    python -m loadtest.bench_kv_memory [--shape gemma3-1b] [--tokens 2048 8192]

The bytes are the blocks' bytes as allocated (a block id is one group's layers); the ratio is
held / one table.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from typing import Any

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (transformers arch, config): the KV-relevant shapes of the released models.
    "gemma3-1b": (
        "gemma3",
        dict(
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            query_pre_attn_scalar=256,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
        ),
    ),
    "gemma2-2b": (
        "gemma2",
        dict(
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            sliding_window=4096,
            query_pre_attn_scalar=256,
        ),
    ),
    "mistral-7b": (
        "mistral",
        dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=4096),
    ),
}


ARCHS = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}
VOCAB = 512


def build(shape: str, path: str, max_len: int) -> None:
    """A random checkpoint of `shape` and a word-level tokenizer of VOCAB tokens, saved to `path`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    arch, config = SHAPES[shape]
    config_cls, model_cls = (getattr(transformers, name) for name in ARCHS[arch])
    hf_config = config_cls(
        hidden_size=64, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=max_len, **config
    )
    torch.manual_seed(0)
    model_cls(hf_config).float().eval().save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t1", eos_token="t2").save_pretrained(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-1b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)

    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.request import SamplingParams
    from models.loader import load_model

    max_len = max(args.tokens) + 16
    with tempfile.TemporaryDirectory() as path:
        build(args.shape, path, max_len)
        loaded = load_model(path, dtype="float32")
    print(
        f"{args.shape}: KV held by one request once its prompt is computed (block size {args.block_size}, float32 KV)"
    )
    print("| prompt tokens | groups (window: blocks) | KV held | one table for every layer | ratio |")
    print("|---|---|---|---|---|")
    for num_tokens in args.tokens:
        core = EngineCore(
            loaded,
            EngineConfig(
                block_size=args.block_size, max_model_len=max_len, kv_cache_memory_gib=4.0, enable_prefix_caching=False
            ),
        )
        layout, spec = core.runner.kv_layout, core.runner.kv_cache_spec
        bm = core.scheduler.block_manager
        prompt = [random.Random(num_tokens).randrange(VOCAB) for _ in range(num_tokens)]
        core.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        held = None
        while core.has_unfinished:
            core.step()
            if core.scheduler.running:  # after a decode step (the window released), before it finishes
                held = [bm.num_held_blocks(g) for g in range(len(layout.windows))]
        if held is None:
            raise RuntimeError(f"{num_tokens} tokens: the request finished without a decode step to measure")
        block_bytes = spec.bytes_per_entry * args.block_size
        ours = sum(held) * layout.num_slots * block_bytes
        # The same tokens (the prompt and the first token computed) in one table for every layer.
        single = -(-(num_tokens + 1) // args.block_size) * spec.num_layers * block_bytes
        groups = ", ".join(f"{w or 'full'}: {n}" for w, n in zip(layout.windows, held))
        print(f"| {num_tokens} | {groups} | {ours / 2**20:.1f} MiB | {single / 2**20:.1f} MiB | {ours / single:.3f} |")


if __name__ == "__main__":
    main()
