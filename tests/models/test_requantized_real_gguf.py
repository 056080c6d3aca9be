"""Real files requantized by llama.cpp's own quantizer (`llama-quantize --allow-requantize`) from
the Qwen2.5 Coder 0.5B Q4_K_M file, one a file type: every tensor of a type we serve as stored
(EXACT_FORMATS) is a layer holding the file's numbers, and the perplexity stays within 1% of
transformers' float32 on the same file (test_qwen_gguf's reference, computed here from the file).

Qwen 0.5B's hidden size (896) is no multiple of 256, so llama.cpp stores its 896-column tensors in
its fallback types (Q2_K, Q3_K -> Q4_0; IQ4_XS -> IQ4_NL; Q4_K -> Q5_0; Q5_K -> Q5_1; Q6_K -> Q8_0): the K-quant
(or IQ4_XS) itself is in the 4864-column `ffn_down` (and the embedding where the type's rules put it there).
The requantized files are kept under the cache (~/.cache/pagedserve/requantized/): reruns are cheap.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from loadtest.perplexity import DEFAULT_TEXT, perplexity
from models.gguf import EXACT_FORMATS, quantized_weight, serving_format, tensor_name_map
from models.layers.linear import MergedLinear

pytestmark = pytest.mark.slow  # a 0.5B model loaded, and once more as float32, per file type

# Built beside llama-server by ../shared/peers/llama-server.sh (llama.cpp from the llama-cpp-python sdist).
LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "llama.cpp-0.3.36"))
LLAMA_QUANTIZE = LLAMA_CPP_DIR / "llama.cpp" / "build" / "bin" / "llama-quantize"
# llama-quantize's file type (`-pure`: its --pure, every tensor the type or its fallback) -> the K-quant
# or type it puts in this model: Q2_K stores `ffn_down` as Q3_K and nothing as Q2_K but with --pure,
# Q3_K_M stores `ffn_down` as Q4_K and Q5_K.
FILE_TYPES = {
    "Q2_K": "Q3_K",
    "Q2_K-pure": "Q2_K",
    "Q3_K_M": "Q4_K",
    "Q5_K_M": "Q5_K",
    "Q5_1": "Q5_1",
    "Q6_K": "Q6_K",
    "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS",
}


def requantized(source: Path, file_type: str) -> Path:
    """`source` requantized to `file_type` by llama-quantize, made once and kept under the cache."""
    from models.fetch import cache_dir

    out = cache_dir() / "requantized" / f"{source.stem}-to-{file_type.lower()}.gguf"
    if out.is_file():
        return out
    if not LLAMA_QUANTIZE.is_file():
        pytest.skip(f"no llama-quantize at {LLAMA_QUANTIZE} (../shared/peers/llama-server.sh builds it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    flags = ["--allow-requantize"] + (["--pure"] if file_type.endswith("-pure") else [])
    try:
        subprocess.run(
            [str(LLAMA_QUANTIZE), *flags, str(source), str(tmp), file_type.removesuffix("-pure")]
            + [str(os.cpu_count() or 1)],
            check=True,
            timeout=1800,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def served_as_stored(path: Path, loaded) -> tuple[Counter, dict[str, str]]:
    """Checks every 2-D tensor of the file against the layer it went to. -> (GGUF type -> how many
    tensors are served as stored: a layer of the type's own format, or int5 for an int4 type, whose
    rows are the file's numbers bit for bit and, in the type's own format, its bytes too; GGUF name ->
    'TYPE -> method' for the rest: types with no exact form, and parts of a merged layer that a
    wider part made int8, requantized at load)."""
    model, config = loaded.model, loaded.config.hf_config
    names = tensor_name_map(config, "qwen2")  # Qwen2: no row reordering (llama's Q/K is)
    stored, requantized = Counter(), {}
    for tensor in GGUFReader(path).tensors:
        if len(tensor.shape) != 2:
            continue
        module_path, _, _ = names[tensor.name].rpartition(".")
        try:
            layer, rows = model.get_submodule(module_path), None
        except AttributeError:  # a part of a merged projection
            parent, _, shard = module_path.rpartition(".")
            layer = next(
                m
                for m in model.get_submodule(parent).children()
                if isinstance(m, MergedLinear) and shard in m.shard_sizes
            )
            rows = layer.shard_rows(shard)
        qtype, method = tensor.tensor_type, layer.quant_method
        fmt = serving_format(qtype)
        # a table type (IQ4_NL, IQ4_XS) is exact only through the table (int4's or int5's values are not its)
        same_kind = getattr(method, "table", False) == fmt.table
        if (
            qtype not in EXACT_FORMATS
            or not same_kind
            or getattr(method, "bits", None) not in (fmt[0], 5 if fmt[0] == 4 else None)
        ):
            requantized[tensor.name] = f"{qtype.name} -> {method.name}"
            continue
        n, k = (int(d) for d in reversed(tensor.shape))
        index = torch.arange(n) if rows is None else torch.arange(rows.start, rows.stop)
        held = method._stored(layer, index)
        blocks = np.asarray(tensor.data)
        want = np.asarray(dequantize(blocks, qtype)).reshape(n, k)
        assert np.array_equal(held.dequantize().numpy(), want), tensor.name
        if held.bits == fmt[0]:
            file = quantized_weight(blocks, qtype, n, k)
            assert torch.equal(held.qweight, file.qweight) and torch.equal(held.scales, file.scales), tensor.name
        stored[qtype.name] += 1
    return stored, requantized


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_a_file_requantized_by_llama_cpp_is_served_as_stored_within_one_percent(qwen05_servable, file_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.loader import load_model

    path = requantized(qwen05_servable, file_type)
    text = DEFAULT_TEXT.read_text()
    loaded = load_model(str(path))
    stored, fell_back = served_as_stored(path, loaded)
    print(f"{file_type}: served as stored {dict(stored)}; requantized at load {Counter(fell_back.values())}")
    named = FILE_TYPES[file_type]
    if GGMLQuantizationType[named] in EXACT_FORMATS:
        assert stored[named] > 0, stored  # the type named is in the file, served as stored
    else:
        assert any(how.startswith(f"{named} ->") for how in fell_back.values()), fell_back
    ours, count = perplexity(loaded, text)
    ids = loaded.tokenizer(text).input_ids
    del loaded
    gc.collect()
    reference_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert reference_tokenizer(text).input_ids == ids
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:-1]])).logits[0]  # (n - 1, vocab)
    reference = math.exp(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:])).item())
    del model
    gc.collect()
    print(f"{file_type}: perplexity over {count} tokens: served {ours:.4f}, transformers float32 {reference:.4f}")
    assert abs(ours / reference - 1) < 0.01, (ours, reference)


def test_the_q4_k_m_files_q6_k_layers_are_the_files_bytes(qwen05_servable):
    from models.loader import load_model

    loaded = load_model(str(qwen05_servable))
    stored, _ = served_as_stored(qwen05_servable, loaded)
    assert stored["Q6_K"] > 0 and stored["Q4_K"] > 0
