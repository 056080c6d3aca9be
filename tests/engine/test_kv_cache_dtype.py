"""--kv-cache-dtype: the model's dtype by default, float16 under float32 activations with
quantized weights (half the memory, as llama.cpp), or what the operator names: int8 quantizes
each key and value row with its own scale (models/layers/attention.py's quantize_rows)."""

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
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, int8"):
        EngineConfig(kv_cache_dtype="int4")


def test_an_int8_cache_holds_about_four_times_the_float32_tokens(loaded):
    """The same --kv-cache-memory holds (4 D) / (D + 2) times the float32 tokens (the tiny model's
    head dim is 16: 3.6x; SmolLM2's 64: 3.9x), the float16 scales counted; the pool's bytes are its blocks'."""
    sized = {}
    for dtype in ("float32", "bfloat16", "int8"):
        runner = LLM.from_loaded(loaded, kv_cache_memory_gib=0.001, kv_cache_dtype=dtype).engine.runner
        spec = runner.kv_cache_spec
        assert runner.kv_cache_bytes == runner.num_blocks * runner.block_size * spec.bytes_per_token
        assert runner.kv_cache_bytes <= 0.001 * 2**30
        sized[dtype] = runner.num_tokens_capacity
    head_dim = loaded.model.kv_cache_spec(torch.float32).entry_shape[-1]
    assert sized["int8"] / sized["float32"] == pytest.approx(4 * head_dim / (head_dim + 2), rel=0.02)
    assert sized["int8"] / sized["bfloat16"] == pytest.approx(2 * head_dim / (head_dim + 2), rel=0.02)


def test_int8_cache_logits_stay_near_float32(loaded):
    """Prefill logits over an int8 cache against a float32 one, every query reading its keys from
    the cache: within 2% (relative, over a position's logits: each cached number is off by at
    most 1/254 of its row's largest), and the same greedy token at every position but a near tie."""
    from loadtest.perplexity import next_token_logits

    ids = [(7 * i * i + 3 * i + 1) % 290 + 5 for i in range(60)]
    ref = next_token_logits(loaded, ids, kv_cache_dtype=torch.float32)
    got = next_token_logits(loaded, ids, kv_cache_dtype=torch.int8)
    relative = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert relative.max().item() < 2e-2
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (got - ref).abs().max(dim=-1).values
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear]) and clear.sum() >= len(ids) // 2


def test_int8_cache_serves_greedy_requests(loaded):
    """Greedy decoding over an int8 cache completes, and its first tokens are float32's: the random
    tiny model's logits differ by ~1e-2 (above), so later tokens may part at a near tie."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    prompt = [5, 9, 200, 17, 33, 41, 8]
    [int8] = LLM.from_loaded(loaded, num_kv_blocks=16, kv_cache_dtype="int8").generate([prompt], params)
    [full] = LLM.from_loaded(loaded, num_kv_blocks=16, kv_cache_dtype="float32").generate([prompt], params)
    assert len(int8.token_ids) == len(full.token_ids) == 12
    assert int8.token_ids[:4] == full.token_ids[:4]
    assert int8.logprobs is not None and full.logprobs is not None
    assert int8.logprobs[0].logprob == pytest.approx(full.logprobs[0].logprob, abs=2e-2)


def test_int8_cache_request_alone_or_in_a_batch_is_the_same(q4_gguf):
    """On the CPU kernels a request's tokens (and logprobs) over an int8 cache are the same bits alone
    or beside others, prefilled at once or in chunks: quantizing a row depends on that row alone.
    (A Q4_1 model: its products, and so its steps, are row-invariant; a decoder layer runs as one op.)"""
    from models.layers import cpu_kernels

    loaded = load_model(str(q4_gguf), dtype="float32")
    if not (cpu_kernels.available() and loaded.model.row_invariant()):
        pytest.skip("row-invariant steps need the CPU kernels")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    prompt = [5, 9, 200, 17, 33, 41, 8, 90, 3, 77, 150, 12, 19]
    others = [[11, 12, 13], [200, 199, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33], [4] * 30]
    [alone] = LLM.from_loaded(loaded, num_kv_blocks=64, kv_cache_dtype="int8").generate([prompt], params)
    batch = LLM.from_loaded(
        loaded, num_kv_blocks=64, kv_cache_dtype="int8", max_num_batched_tokens=8, max_num_seqs=4
    ).generate([others[0], prompt, *others[1:]], params)
    assert batch[1].token_ids == alone.token_ids
    assert batch[1].logprobs == alone.logprobs


def test_int8_latent_cache_serves_mla(tmp_path, monkeypatch):
    """DeepSeek's latent cache in int8 (one scale a token: the latent and its rotary key together),
    prompts in chunks beside decodes. Against transformers (the float32 cache is within 1e-4 there,
    tests/models/test_deepseek.py) most positions' logits are within 3% of the largest; a few move
    more, where the tiny random MoE's router picks another expert from a near tie. The C++ kernel
    and the PyTorch path read the int8 cache alike: most positions' logits to 1e-5, a few to 5e-3 where a
    latent's number fell near a rounding boundary of its row's int8 grid and, its float32 bits differing
    in the last place between the paths, rounded one way on one and the other way on the other (a step of
    1/127 of its row; docs/benchmarks.md)."""
    from models.layers import cpu_kernels
    from models.loader import load_model
    from tests.models.conftest import paged_forward, save_checkpoint, shuffled_block_tables
    from tests.models.test_deepseek import make_hf_deepseek

    hf = make_hf_deepseek("v3-q-lora")
    model = load_model(str(save_checkpoint(hf, tmp_path / "mla")), dtype="float32").model
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 1, 14, 5)]
    with torch.no_grad():
        reference = torch.cat([hf(input_ids=torch.tensor([p])).logits[0].float() for p in prompts])
    block_size = 3
    tables, num_blocks = shuffled_block_tables([len(p) for p in prompts], block_size, seed=block_size)

    def run() -> torch.Tensor:
        caches = model.kv_cache_spec(torch.int8).allocate(num_blocks, block_size, "cpu")
        assert caches[0].shape[-1] == model.kv_cache_spec(torch.float32).entry_shape[0] + 2  # its float16 scale
        done, outputs = [0] * len(prompts), [[] for _ in prompts]
        while any(d < len(p) for d, p in zip(done, prompts)):
            chunks = [
                (i, done[i], p[done[i] : done[i] + (4 if done[i] == 0 else 1)])
                for i, p in enumerate(prompts)
                if done[i] < len(p)
            ]
            for (i, start, ids), logits in zip(chunks, paged_forward(model, caches, chunks, tables, block_size)):
                outputs[i].append(logits)
                done[i] = start + len(ids)
        return torch.cat([torch.cat(o) for o in outputs])

    kernel = run() if cpu_kernels.available() else None
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    eager = run()
    relative = (eager - reference).abs().amax(-1) / reference.abs().max()
    assert (relative < 3e-2).float().mean().item() >= 0.85 and relative.median().item() < 2e-2
    if kernel is not None:
        gap = (kernel - eager).abs().amax(-1) / reference.abs().max()
        assert gap.median().item() < 1e-5 and gap.max().item() < 5e-3, gap
