"""On CPU a Llama/Qwen2 layer whose projections all run on the quantized kernel runs as one op
(csrc/decoder_layer.cpp: the same kernels in the same order, without Python between them). It
must give the bits the module-by-module path gives, for prompts, chunks and decodes in one
step, with a float32 or float16 cache, and the step must really have taken it."""

from __future__ import annotations

import pytest
import torch

from models.fetch import default_model_path
from models.layers import cpu_kernels
from models.llama import LlamaDecoderLayer
from models.loader import load_model
from tests.models.conftest import paged_forward, shuffled_block_tables

BLOCK_SIZE = 16


@pytest.fixture(autouse=True)
def kernels():
    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable: no one-op layer without them")


def three_steps(model, kv_dtype: torch.dtype, vocab: int) -> list[torch.Tensor]:
    """Two prompts; their decodes beside a third prompt; then a decode beside a chunk."""
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (37, 20, 45)]
    tables, num_blocks = shuffled_block_tables([40, 24, 48], BLOCK_SIZE)
    kv_caches = model.kv_cache_spec(kv_dtype).allocate(num_blocks, BLOCK_SIZE, "cpu")
    steps = [
        [(0, 0, ids[0][:36]), (1, 0, ids[1][:19])],
        [(0, 36, ids[0][36:]), (1, 19, ids[1][19:]), (2, 0, ids[2][:30])],
        [(2, 30, ids[2][30:]), (0, 37, [5])],
    ]
    return [logits for step in steps for logits in paged_forward(model, kv_caches, step, tables, BLOCK_SIZE)]


def one_op_calls(monkeypatch) -> list[int]:
    calls = []
    real = cpu_kernels.llama_decoder_layer
    monkeypatch.setattr(cpu_kernels, "llama_decoder_layer", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    return calls


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_smollm2_layers_as_one_op_give_the_same_bits(monkeypatch, kv_dtype):
    loaded = load_model(str(default_model_path()), dtype="float32")
    calls = one_op_calls(monkeypatch)
    fused = three_steps(loaded.model, kv_dtype, 49152)
    assert len(calls) == 3 * 30  # every layer of every step
    monkeypatch.setattr(LlamaDecoderLayer, "one_op_args", lambda self, x, kv_cache: None)
    calls.clear()
    modules = three_steps(loaded.model, kv_dtype, 49152)
    assert not calls
    for a, b in zip(fused, modules, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "arch,quantization,overrides",
    [
        ("qwen2", "int4", {}),
        ("llama", "int8", {}),
        ("mistral", "int8", {"sliding_window": 8}),
    ],
)
def test_tiny_layers_as_one_op_give_the_same_bits(monkeypatch, make_checkpoint, arch, quantization, overrides):
    """Qwen2's q/k/v biases, GQA, int8 per-channel and int4 groups; Mistral's sliding window."""
    path, hf_model = make_checkpoint(arch, **overrides)
    loaded = load_model(str(path), dtype="float32", quantization=quantization)
    calls = one_op_calls(monkeypatch)
    fused = three_steps(loaded.model, torch.float32, hf_model.config.vocab_size)
    assert len(calls) == 3 * hf_model.config.num_hidden_layers
    monkeypatch.setattr(LlamaDecoderLayer, "one_op_args", lambda self, x, kv_cache: None)
    modules = three_steps(loaded.model, torch.float32, hf_model.config.vocab_size)
    for a, b in zip(fused, modules, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_int8_cache_keys_with_their_offsets_and_scales_give_the_same_bits(monkeypatch, make_checkpoint, arch):
    """An int8 cache stores each layer's keys less its calibrated per-channel offset (where k_proj has a
    bias: Qwen2) and times its per-channel scale, the queries times the inverse (models/kv_int8.py): the
    one op makes them as the modules do."""
    from models.kv_int8 import calibrate_int8_keys

    path, hf_model = make_checkpoint(arch)
    loaded = load_model(str(path), dtype="float32", quantization="int4")
    calibrate_int8_keys(loaded)
    config = hf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (config.num_key_value_heads, head_dim)
    attns = [layer.self_attn for layer in loaded.model.model.decoder_layers]
    for attn in attns:
        assert (attn.key_offset is not None) == (arch == "qwen2")
        assert attn.key_offset is None or (attn.key_offset.shape == shape and attn.key_offset.abs().sum() > 0)
        assert attn.key_scale is not None and attn.key_scale.shape == shape
        assert attn.query_scale is not None and attn.query_scale.shape == (config.num_attention_heads, head_dim)
        group = config.num_attention_heads // config.num_key_value_heads
        assert torch.equal(attn.key_scale, 1 / attn.query_scale[::group])  # both from one s
        assert not torch.all(attn.key_scale == 1)
    calls = one_op_calls(monkeypatch)
    fused = three_steps(loaded.model, torch.int8, hf_model.config.vocab_size)
    assert len(calls) == 3 * hf_model.config.num_hidden_layers
    monkeypatch.setattr(LlamaDecoderLayer, "one_op_args", lambda self, x, kv_cache: None)
    modules = three_steps(loaded.model, torch.int8, hf_model.config.vocab_size)
    for a, b in zip(fused, modules, strict=True):
        assert torch.equal(a, b)


def test_dense_and_qk_norm_layers_keep_the_module_path(monkeypatch, make_checkpoint):
    calls = one_op_calls(monkeypatch)
    for arch, quantization in (("llama", "none"), ("qwen3", "int4")):
        path, hf_model = make_checkpoint(arch)
        loaded = load_model(str(path), dtype="float32", quantization=quantization)
        three_steps(loaded.model, torch.float32, hf_model.config.vocab_size)
    assert not calls
