"""Perplexity of a model on a text, with the weights served as `--quantization` says.

    python -m loadtest.perplexity --quantization none      # dense (a GGUF dequantized)
    python -m loadtest.perplexity --quantization int8      # then int4, auto: compare the lines
    python -m loadtest.perplexity --model qwen2.5-coder-0.5b-instruct   # a model by name, fetched
    python -m loadtest.perplexity --model NAME --llama-cpp-python ~/venv-with-llama-cpp/bin/python
    python -m loadtest.perplexity --kv-cache-dtype int8 --kv-reference float32 \
        --text loadtest/data/perplexity.txt loadtest/data/perplexity_more.txt

One prefill of the whole text (at most max-model-len tokens) through the paged model, as the
server runs it; the default text (loadtest/data/perplexity.txt: two public-domain passages,
a science paragraph and a short Python function) is ~600 tokens. --llama-cpp-python scores the
same GGUF file and the same token ids at the same positions in llama.cpp too (llama-cpp-python,
run by that interpreter, so our venv never imports it) and prints both perplexities and their ratio.
--kv-reference scores the text again with the cache in another dtype and prints the mean KL
divergence of the next-token distributions too.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from models.kv_int8 import calibrate_int8_keys
from models.layers.attention import AttentionMetadata
from models.layers.quantization import QUANTIZATIONS

if TYPE_CHECKING:
    from models.loader import LoadedModel

DEFAULT_TEXT = Path(__file__).parent / "data" / "perplexity.txt"
# ~1,300 tokens more (public-domain passages, prose and code): with DEFAULT_TEXT, for comparisons that
# move perplexity by tenths of a percent, where the shorter text's spread is as large.
MORE_TEXT = Path(__file__).parent / "data" / "perplexity_more.txt"

# argv: GGUF path, threads; stdin: the token ids (JSON); stdout: {"perplexity": ...}. Row i of
# llm.scores is the logits after ids[i], as in next_token_logits; log-softmax in float64.
_LLAMA_CPP = """
import json, sys
import numpy as np
from llama_cpp import Llama
ids = json.load(sys.stdin)
n = len(ids)
threads = int(sys.argv[2])
llm = Llama(sys.argv[1], n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, n_threads=threads,
            n_threads_batch=threads, verbose=False)
llm.eval(ids[:-1])  # one batch, as our one prefill
x = np.asarray(llm.scores[: n - 1], dtype=np.float64)  # (n - 1, vocab)
top = x.max(axis=1)
nll = top + np.log(np.exp(x - top[:, None]).sum(axis=1)) - x[np.arange(n - 1), ids[1:]]
print(json.dumps({"perplexity": float(np.exp(nll.mean()))}))
"""


@torch.inference_mode()
def next_token_logits(
    loaded: LoadedModel, ids: list[int], block_size: int = 16, kv_cache_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """ids (n tokens, at most max_model_len) in one prefill through the paged model -> (n, vocab):
    row i the logits of the token after ids[i]. kv_cache_dtype: the cache's (default the model's)."""
    n = len(ids)
    num_blocks = -(-n // block_size)
    spec = loaded.model.kv_cache_spec(kv_cache_dtype or loaded.config.dtype)
    if spec.dtype == torch.int8:  # as the server: keys with their calibrated offsets and scales
        calibrate_int8_keys(loaded)
    kv_caches = spec.allocate(num_blocks, block_size, "cpu")
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size)
    hidden = loaded.model(torch.tensor(ids), torch.arange(n), kv_caches, meta)
    return loaded.model.compute_logits(hidden)


def token_ids(loaded: LoadedModel, text: str) -> list[int]:
    """The ids scored: `text` as our tokenizer encodes it (no BOS added unless it adds one), cut to
    max_model_len; every one but the first is predicted from those before it."""
    return loaded.tokenizer(text).input_ids[: loaded.config.max_model_len]


def perplexity(
    loaded: LoadedModel, text: str, block_size: int = 16, kv_cache_dtype: torch.dtype | None = None
) -> tuple[float, int]:
    """-> (perplexity, tokens scored) of `text` under `loaded` (a models.loader.LoadedModel)."""
    ids = token_ids(loaded, text)
    logits = next_token_logits(
        loaded, ids[:-1], block_size, kv_cache_dtype
    )  # (n - 1, vocab): each position predicts the next
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item()), len(ids) - 1


@dataclass(frozen=True)
class KVCacheComparison:
    """One text scored with the KV cache in two dtypes (see kv_cache_comparison)."""

    perplexity: float
    reference_perplexity: float
    kl_divergence: float  # mean over the positions, of the reference's next-token distribution from ours
    tokens: int


def kv_cache_comparison(
    loaded: LoadedModel, text: str, kv_cache_dtype: torch.dtype, reference: torch.dtype, block_size: int = 16
) -> KVCacheComparison:
    """`text` scored with a `kv_cache_dtype` cache and with a `reference` cache: both perplexities and the
    mean KL divergence of the next-token distributions. Perplexity follows the text's own tokens, a few of
    which move it by tenths of a percent; the divergence weighs every position by what the model expects."""
    ids = token_ids(loaded, text)
    ours = next_token_logits(loaded, ids[:-1], block_size, kv_cache_dtype).double().log_softmax(dim=-1)
    ref = next_token_logits(loaded, ids[:-1], block_size, reference).double().log_softmax(dim=-1)
    target = torch.tensor(ids[1:]).unsqueeze(1)
    kl = (ref.exp() * (ref - ours)).sum(dim=-1).mean()
    return KVCacheComparison(
        math.exp(-ours.gather(1, target).mean().item()),
        math.exp(-ref.gather(1, target).mean().item()),
        kl.item(),
        len(ids) - 1,
    )


def llama_cpp_perplexity(python: str, gguf: str, ids: list[int]) -> float:
    """Perplexity of `ids` (scored as `perplexity` scores them) under llama.cpp, run by `python`."""
    result = subprocess.run(
        [python, "-c", _LLAMA_CPP, gguf, str(torch.get_num_threads())],
        input=json.dumps(ids),
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return json.loads(result.stdout)["perplexity"]


def main(argv: list[str] | None = None) -> None:
    from models.loader import DEFAULT_MODEL, load_model

    p = argparse.ArgumentParser(prog="python -m loadtest.perplexity", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint dir, .gguf file, hub id, or a model's name (python -m models.fetch --list)",
    )
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--text",
        type=Path,
        nargs="+",
        default=[DEFAULT_TEXT],
        help="the text to score; several files are read as one text, joined by a newline",
    )
    kv_dtypes = ["auto", "float32", "bfloat16", "float16", "int8"]
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=kv_dtypes,
        help="the KV cache's dtype (auto: the model's); every query of the prefill reads its keys "
        "and values from the cache (int8: quantized, as the server's --kv-cache-dtype int8)",
    )
    p.add_argument(
        "--kv-reference",
        choices=kv_dtypes[1:],
        help="score the text again with the cache in this dtype and print both perplexities and the "
        "mean KL divergence of the next-token distributions from it",
    )
    p.add_argument(
        "--llama-cpp-python",
        metavar="PYTHON",
        help="an interpreter with llama-cpp-python installed: score the same GGUF there too",
    )
    args = p.parse_args(argv)
    loaded = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    text = "\n".join(path.read_text() for path in args.text)
    cache_dtype = None if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
    ppl, count = perplexity(loaded, text, kv_cache_dtype=cache_dtype)
    print(
        f"{args.model} --quantization {args.quantization} ({loaded.quantization}; "
        f"{loaded.weight_bytes / 2**20:.1f} MiB of weights) --kv-cache-dtype {args.kv_cache_dtype}: "
        f"perplexity {ppl:.4f} over {count} tokens"
    )
    if args.kv_reference:
        found = kv_cache_comparison(loaded, text, cache_dtype or loaded.config.dtype, getattr(torch, args.kv_reference))
        print(
            f"--kv-cache-dtype {args.kv_reference}: perplexity {found.reference_perplexity:.4f}; "
            f"{args.kv_cache_dtype} / {args.kv_reference} {found.perplexity / found.reference_perplexity:.4f}, "
            f"mean KL divergence {found.kl_divergence:.5f}"
        )
    if args.llama_cpp_python:
        if not loaded.config.path.endswith(".gguf"):
            p.error(f"--llama-cpp-python needs a GGUF model, not {loaded.config.path}")
        reference = llama_cpp_perplexity(args.llama_cpp_python, loaded.config.path, token_ids(loaded, text))
        print(
            f"llama.cpp (llama-cpp-python, {Path(loaded.config.path).name}): perplexity {reference:.4f} "
            f"over the same {count} tokens; ours / llama.cpp {ppl / reference:.4f}"
        )


if __name__ == "__main__":
    main()
