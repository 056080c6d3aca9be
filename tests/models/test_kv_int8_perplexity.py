"""Perplexity with the KV cache in int8 against a float32 cache, on real trained models as served.

loadtest.perplexity runs the text (~500 tokens) in one prefill with every query reading its keys and
values from the cache, so each quantized row is read by every later position. Both caches are
computed here, in the same process, through both attention paths (our C++ kernel and the PyTorch
paths); the bound is the one `--kv-cache-dtype int8` aims at: within 0.5%. SmolLM2 holds it; Qwen2.5's
keys do not (the xfail below says why), which a strict xfail keeps in view until a format that holds it.
"""

from __future__ import annotations

import pytest
import torch

from loadtest.perplexity import DEFAULT_TEXT, perplexity

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("attention_path")]


def int8_against_float32(path) -> tuple[float, float, int]:
    from models.loader import load_model

    loaded = load_model(str(path))  # what `python -m server --model` builds: dtype and quantization auto
    text = DEFAULT_TEXT.read_text()
    full, count = perplexity(loaded, text, kv_cache_dtype=torch.float32)
    int8, same_count = perplexity(loaded, text, kv_cache_dtype=torch.int8)
    assert same_count == count > 400
    return full, int8, count


@pytest.fixture(scope="module")
def smollm2_gguf():
    from models.fetch import default_model_path

    return default_model_path()


def test_smollm2_perplexity_with_an_int8_cache_is_within_half_a_percent_of_float32(smollm2_gguf, attention_path):
    full, int8, count = int8_against_float32(smollm2_gguf)
    print(f"SmolLM2-135M, {attention_path}, {count} tokens: float32 KV {full:.4f}, int8 KV {int8:.4f}")
    assert abs(int8 / full - 1) < 0.005, (int8, full)


@pytest.mark.xfail(
    strict=True,
    reason="one int8 scale per key row costs Qwen2.5-Coder-0.5B 9% of perplexity (float32 KV 14.02, int8 "
    "15.30 on the kernel, 15.31 on the PyTorch paths): its keys carry a few channels ~20x the rest (the "
    "k_proj bias, in slow rotary dimensions), so a row's scale follows them and its other channels keep few "
    "levels; see docs/benchmarks.md",
)
def test_qwen05_perplexity_with_an_int8_cache_is_within_half_a_percent_of_float32(qwen05_servable, attention_path):
    full, int8, count = int8_against_float32(qwen05_servable)
    print(f"Qwen2.5-Coder-0.5B, {attention_path}, {count} tokens: float32 KV {full:.4f}, int8 KV {int8:.4f}")
    assert abs(int8 / full - 1) < 0.005, (int8, full)
