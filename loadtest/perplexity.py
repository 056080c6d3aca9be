"""Perplexity of a model on a text, with the weights served as `--quantization` says.

    python -m loadtest.perplexity --quantization none      # dense (a GGUF dequantized)
    python -m loadtest.perplexity --quantization int8      # then int4, auto: compare the lines
    python -m loadtest.perplexity --model qwen2.5-coder-0.5b-instruct   # a model by name, fetched

One prefill of the whole text (at most max-model-len tokens) through the paged model, as the
server runs it; the default text (loadtest/data/perplexity.txt: two public-domain passages,
a science paragraph and a short Python function) is ~600 tokens.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from models.layers.attention import AttentionMetadata
from models.layers.quantization import QUANTIZATIONS

DEFAULT_TEXT = Path(__file__).parent / "data" / "perplexity.txt"


@torch.inference_mode()
def next_token_logits(loaded, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """ids (n tokens, at most max_model_len) in one prefill through the paged model -> (n, vocab):
    row i the logits of the token after ids[i]."""
    n = len(ids)
    num_blocks = -(-n // block_size)
    kv_caches = loaded.model.kv_cache_spec(loaded.config.dtype).allocate(num_blocks, block_size, "cpu")
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size)
    hidden = loaded.model(torch.tensor(ids), torch.arange(n), kv_caches, meta)
    return loaded.model.compute_logits(hidden)


def perplexity(loaded, text: str, block_size: int = 16) -> tuple[float, int]:
    """-> (perplexity, tokens scored) of `text` under `loaded` (a models.loader.LoadedModel)."""
    ids = loaded.tokenizer(text).input_ids[: loaded.config.max_model_len]
    logits = next_token_logits(loaded, ids[:-1], block_size)  # (n - 1, vocab): each position predicts the next
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item()), len(ids) - 1


def main(argv: list[str] | None = None) -> None:
    from models.loader import DEFAULT_MODEL, load_model

    p = argparse.ArgumentParser(prog="python -m loadtest.perplexity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint dir, .gguf file, hub id, or a model's name (python -m models.fetch --list)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    args = p.parse_args(argv)
    loaded = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    ppl, count = perplexity(loaded, args.text.read_text())
    print(f"{args.model} --quantization {args.quantization} ({loaded.quantization}; "
          f"{loaded.weight_bytes / 2**20:.1f} MiB of weights): perplexity {ppl:.3f} over {count} tokens")


if __name__ == "__main__":
    main()
