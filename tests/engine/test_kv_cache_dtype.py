"""--kv-cache-dtype: the model's dtype by default, float16 under float32 activations with
quantized weights (half the memory, as llama.cpp), or what the operator names."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from models.loader import load_model
from tests.models.test_gguf import tiny_llama, write_gguf


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4") / "m.gguf"
    write_gguf(path, tiny_llama(tie=True), GGMLQuantizationType.Q4_1)
    return path


def cache_dtype(loaded, **kwargs) -> torch.dtype:
    llm = LLM.from_loaded(loaded, num_kv_blocks=8, **kwargs)
    dtypes = {c.dtype for c in llm.engine.runner.kv_caches}
    assert len(dtypes) == 1
    return dtypes.pop()


def test_quantized_float32_model_keeps_a_float16_cache_by_default(q4_gguf):
    quantized = load_model(str(q4_gguf), dtype="float32")
    assert quantized.is_quantized
    assert cache_dtype(quantized) == torch.float16
    assert cache_dtype(quantized, kv_cache_dtype="float32") == torch.float32
    assert cache_dtype(quantized, kv_cache_dtype="bfloat16") == torch.bfloat16
    dense = load_model(str(q4_gguf), dtype="float32", quantization="none")
    assert not dense.is_quantized and cache_dtype(dense) == torch.float32


def test_a_float16_cache_halves_the_pool_and_serves(q4_gguf):
    loaded = load_model(str(q4_gguf), dtype="float32")
    small = LLM.from_loaded(loaded, num_kv_blocks=8)
    full = LLM.from_loaded(loaded, num_kv_blocks=8, kv_cache_dtype="float32")
    assert 2 * small.engine.runner.kv_cache_bytes == full.engine.runner.kv_cache_bytes
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [half] = small.generate([[5, 9, 200, 17, 33]], params)
    [single] = full.generate([[5, 9, 200, 17, 33]], params)
    assert len(half.token_ids) == len(single.token_ids) == 12
    assert half.token_ids[:4] == single.token_ids[:4]  # rounding K/V to fp16 moves logits by ~1e-3 at most


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16"):
        EngineConfig(kv_cache_dtype="int8")
