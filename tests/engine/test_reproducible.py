"""The same seeded request gives the same text and logprobs every time: six times in
a row with prefix caching on (from the second time on, its prompt's full blocks come from the
cache and the rest is a chunk after them), and among other requests, while the thread tuner
switches between 2 threads and 1. Holds where every linear layer is row-invariant."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.request import SamplingParams
from models.layers import cpu_kernels
from tests.models.test_row_invariance import row_by_row

SEEDED = SamplingParams(temperature=1.0, seed=123, max_tokens=16, logprobs=2, ignore_eos=True)
PROMPT = [(7 * i) % 290 + 3 for i in range(29)]


@pytest.fixture(autouse=True)
def two_threads():
    """Two threads for the runner's tuner to choose from (the engine tests' default is one)."""
    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable: the eager paths make no such promise")
    torch.set_num_threads(2)


def assert_reproducible(llm: LLM) -> None:
    assert llm.engine.runner.step_tuner.candidates(1)[0].num_threads == 2  # both counts in play
    runs = [llm.generate(PROMPT, SEEDED)[0] for _ in range(6)]
    others = [SamplingParams(temperature=0.7, seed=s, max_tokens=20, ignore_eos=True) for s in (1, 2)]
    among = llm.generate([PROMPT[:11] + [5, 6], PROMPT, PROMPT[::-1]], [others[0], SEEDED, others[1]])[1]
    assert runs[0].num_cached_tokens == 0 and all(r.num_cached_tokens > 0 for r in runs[1:])
    for result in runs[1:] + [among]:
        assert result.token_ids == runs[0].token_ids and result.text == runs[0].text
        assert result.logprobs == runs[0].logprobs  # token ids, values and top alternatives, exactly


def test_a_seeded_request_repeats_exactly_where_every_linear_layer_is_row_invariant(tiny_llama):
    from models.loader import load_model

    loaded = row_by_row(load_model(tiny_llama[0], dtype="float32"))
    assert_reproducible(LLM.from_loaded(loaded, block_size=8, num_kv_blocks=64, kv_cache_dtype="float16"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_seeded_request_to_a_dense_model_repeats_exactly_with_batch_invariant(tiny_llama, dtype):
    llm = LLM(str(tiny_llama[0]), dtype=dtype, batch_invariant=True, block_size=8, num_kv_blocks=64)
    assert llm.engine.runner.model.row_invariant()
    assert_reproducible(llm)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_seeded_request_to_a_quantized_model_repeats_exactly(tiny_llama, quantization):
    llm = LLM(str(tiny_llama[0]), dtype="float32", quantization=quantization, block_size=8, num_kv_blocks=64)
    assert_reproducible(llm)


@pytest.mark.parametrize("case", ["v2-group-limited-q-lora-yarn", "v3-q-lora"])
def test_a_seeded_request_to_a_quantized_deepseek_repeats_exactly(tmp_path, case):
    """MLA's absorbed products and the MoE router on csrc/rows_matmul.cpp: with torch's batched
    matmuls a row's rounding, and so the experts chosen, followed its step."""
    from tests.models.test_deepseek import save_quantizable_deepseek

    path = save_quantizable_deepseek(case, tmp_path / case)
    llm = LLM(str(path), dtype="float32", quantization="int8", block_size=8, num_kv_blocks=64)
    assert llm.engine.runner.model.row_invariant()
    assert_reproducible(llm)


def test_the_real_smollm2_gguf_as_stored_repeats_a_seeded_request_exactly():
    """The issue's conformance check on the default model (Q4_1 blocks, Q8_0 embedding, float16
    cache): used to differ on the second of six runs with 2 threads."""
    from models.fetch import default_model_path

    assert_reproducible(LLM(str(default_model_path()), block_size=16, num_kv_blocks=64))
