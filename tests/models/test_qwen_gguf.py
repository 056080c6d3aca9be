"""The real Qwen2.5 Coder 0.5B Instruct (Q4_K_M GGUF, fetched by name) as served, against transformers.

transformers reads the same GGUF file and dequantizes every tensor exactly into float32; we
serve it as the server does (`--quantization auto`: Q4_K kept as int4, Q6_K as int6,
Q5_0/Q8_0 as int8).
The reference is computed here, from the file, never written down.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from loadtest.perplexity import DEFAULT_TEXT, perplexity

pytestmark = pytest.mark.slow  # a 0.5B model loaded twice, once as float32


def test_perplexity_as_served_is_within_one_percent_of_transformers_float32(qwen05_servable):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.loader import load_model

    path, text = qwen05_servable, DEFAULT_TEXT.read_text()
    loaded = load_model(str(path))  # what `python -m server --model` builds: dtype and quantization auto
    ours, count = perplexity(loaded, text)
    ids = loaded.tokenizer(text).input_ids
    del loaded
    gc.collect()

    reference_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert reference_tokenizer(text).input_ids == ids  # the same tokens scored on both sides
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:-1]])).logits[0]  # (n - 1, vocab)
    reference = math.exp(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:])).item())
    print(f"perplexity over {count} tokens: served {ours:.4f}, transformers float32 {reference:.4f}")
    assert count > 400
    assert abs(ours / reference - 1) < 0.01, (ours, reference)
