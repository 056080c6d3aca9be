"""Perplexity with the KV cache in int8 against a float32 cache, on real trained models as served.

loadtest.perplexity runs the text (~500 tokens) in one prefill with every query reading its keys and
values from the cache, so each quantized row is read by every later position. Both caches are
computed here, in the same process, through both attention paths (our C++ kernel and the PyTorch
paths); the bound is the one `--kv-cache-dtype int8` aims at: within 0.5%. SmolLM2 holds it on both;
Qwen2.5, its keys stored less their calibrated offsets, on the kernel but not on the PyTorch paths (the
xfail below says why), which a strict xfail keeps in view.
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


def test_qwen05_perplexity_with_an_int8_cache_is_within_half_a_percent_of_float32(
    qwen05_servable, attention_path, request
):
    if attention_path == "pytorch":
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="with its keys stored less their calibrated offsets (models/kv_int8.py) Qwen2.5-Coder-0.5B "
                "is within 0.5% on the kernel (float32 KV 14.0249, int8 14.0871, +0.44%) but not on the PyTorch "
                "paths (14.0254, 14.1248, +0.71%; +9.2% without the offsets): the paths' float32 keys differ in "
                "the last bits, so numbers near a rounding boundary of the int8 grid round apart; see "
                "docs/benchmarks.md",
            )
        )
    full, int8, count = int8_against_float32(qwen05_servable)
    print(f"Qwen2.5-Coder-0.5B, {attention_path}, {count} tokens: float32 KV {full:.4f}, int8 KV {int8:.4f}")
    assert abs(int8 / full - 1) < 0.005, (int8, full)
