"""models.gguf against GGUF files written here, the way llama.cpp's converter writes them.

A tiny random HF Llama is written with gguf.GGUFWriter (llama.cpp tensor names, Q/K rows
permuted, reversed shapes, the package's own quantizers), then read back with load_gguf
and compared with the HF state dict it came from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from models.gguf import GGUFError, load_gguf, read_config, tensor_name_map

Q = GGMLQuantizationType
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"

# A byte-level BPE vocabulary: three specials, the 256 byte symbols, and a few merges.
_BYTES = list(bytes_to_unicode().values())
SPECIALS = ["<unk>", "<s>", "</s>", "<eot>"]
MERGES = ["h e", "l l", "he ll", "o Ġ", "w o"]
TOKENS = SPECIALS + _BYTES + [m.replace(" ", "") for m in MERGES]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, the transform the reader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(tie: bool = False, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=len(TOKENS),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=tie,
    )
    config = LlamaConfig(**{**kwargs, **overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms are ones at init; make them informative
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module>.<proj>.weight
    layer, module = parts[2], ".".join(parts[3:-1])
    kind = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }[module]
    return f"blk.{layer}.{kind}.{parts[-1]}"


def random_k_blocks(array: np.ndarray, qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Random blocks of a K-quant (which the gguf package cannot quantize) for a tensor of `array`'s
    shape: random 6-bit scales and values, the fp16 d and dmin small enough for a model's weights."""
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = array.shape
    rng = np.random.default_rng(seed + rows * cols)
    blocks = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(1e-4, 3e-4, (rows, cols // block_values, 1)).astype(np.float16).view(np.uint8)
    blocks[..., 2:4] = rng.uniform(1e-4, 3e-4, (rows, cols // block_values, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(
    path,
    model: LlamaForCausalLM,
    qtype=Q.F32,
    arch: str = "llama",
    rope_scaling=None,
    extra_tensors=(),
    quantizer=quantize,
) -> None:
    """`quantizer(array, qtype)`: the blocks of a 2-D tensor (default: the gguf package's quantizer)."""
    cfg = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.head_dim)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    # A larger vocab_size (one tensor parallelism can split) gets unused tokens at the end.
    tokens = TOKENS + [f"<unused{i}>" for i in range(cfg.vocab_size - len(TOKENS))]
    writer.add_token_list(tokens)
    writer.add_token_types(
        [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)) + [5] * (len(tokens) - len(TOKENS))
    )
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        array = tensor.numpy()
        if ".q_proj." in hf_name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif ".k_proj." in hf_name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if array.ndim == 1:  # llama.cpp keeps norms in F32 whatever the file type
            writer.add_tensor(gguf_name(hf_name), array)
        else:
            data = quantizer(array, qtype)
            writer.add_tensor(gguf_name(hf_name), data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    for name, data, raw_dtype in extra_tensors:
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read(path, tmp_path):
    config, weights, tokenizer, eos = load_gguf(path, cache=tmp_path / "cache")
    return config, dict(weights), tokenizer, eos


def test_tensor_names_map_to_hf(tmp_path):
    """gguf-py's name table over transformers' parameter names, for a llama file."""
    from gguf import GGUFReader

    write_gguf(tmp_path / "m.gguf", tiny_llama())
    config = read_config(GGUFReader(tmp_path / "m.gguf"), tmp_path / "m.gguf")
    names = tensor_name_map(config, "llama")
    assert names["token_embd.weight"] == "model.embed_tokens.weight"
    assert names["output.weight"] == "lm_head.weight"
    assert names["output_norm.weight"] == "model.norm.weight"
    assert names["blk.1.attn_output.weight"] == "model.layers.1.self_attn.o_proj.weight"
    assert names["blk.0.ffn_norm.weight"] == "model.layers.0.post_attention_layernorm.weight"
    assert names["blk.1.ffn_gate.weight"] == "model.layers.1.mlp.gate_proj.weight"
    assert "blk.0.ffn_gate_exps.weight" not in names


def test_f32_file_gives_the_hf_checkpoint_exactly(tmp_path):
    model = tiny_llama()
    write_gguf(tmp_path / "m.gguf", model, Q.F32)
    config, weights, _, eos = read(tmp_path / "m.gguf", tmp_path)
    expected = model.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32 and weights[name].shape == tensor.shape, name
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
    ref = model.config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(config, key) == getattr(ref, key), key
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    assert eos == (2, 3)


def test_f32_weights_give_hf_logits(tmp_path):
    model = tiny_llama()
    write_gguf(tmp_path / "m.gguf", model, Q.F32)
    config, weights, _, _ = read(tmp_path / "m.gguf", tmp_path)
    reloaded = LlamaForCausalLM(config).eval()
    reloaded.load_state_dict(weights)
    ids = torch.tensor([[5, 9, 200, 17, 33, 4]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "qtype,max_rel_err",
    [(Q.F16, 1e-3), (Q.Q8_0, 0.01), (Q.Q4_1, 0.12), (Q.Q4_0, 0.15)],
    ids=["F16", "Q8_0", "Q4_1", "Q4_0"],
)
def test_quantized_file_gives_hf_weights_within_quantization_error(tmp_path, qtype, max_rel_err):
    model = tiny_llama(tie=True)
    write_gguf(tmp_path / "m.gguf", model, qtype)
    config, weights, _, _ = read(tmp_path / "m.gguf", tmp_path)
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        got = weights[name]
        assert got.shape == tensor.shape, name
        if tensor.ndim == 1:
            torch.testing.assert_close(got, tensor, rtol=0, atol=0, msg=name)
            continue
        assert got.dtype == (torch.float16 if qtype == Q.F16 else torch.float32), name
        # Blocks run along rows and the Q/K permutation moves whole rows, so quantizing the
        # permuted tensor equals quantizing the HF one: the round trip must match exactly.
        round_trip = dequantize(quantize(tensor.numpy(), qtype), qtype).reshape(tensor.shape)
        np.testing.assert_array_equal(got.float().numpy(), round_trip, err_msg=name)
        rel = (got.float() - tensor).norm() / tensor.norm()
        assert rel < max_rel_err, (name, rel.item())


def test_tokenizer_eos_and_chat_template_come_from_metadata(tmp_path):
    write_gguf(tmp_path / "m.gguf", tiny_llama())
    _, _, tokenizer, eos = read(tmp_path / "m.gguf", tmp_path)
    assert eos == (2, 3)
    assert tokenizer.eos_token == "</s>" and tokenizer.bos_token == "<s>"
    hello = tokenizer("hello</s>", add_special_tokens=True).input_ids
    assert tokenizer.convert_ids_to_tokens(hello) == ["hell", "o", "</s>"]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<s>user\nhi</s>\n"


def test_tokenizer_is_cached_by_the_files_metadata_and_the_cached_copy_behaves_the_same(tmp_path, monkeypatch):
    write_gguf(tmp_path / "m.gguf", tiny_llama())
    _, _, first, _ = load_gguf(tmp_path / "m.gguf", cache=tmp_path / "cache")
    saved = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(saved) == 1 and saved[0].name.startswith("gguf-")
    # the same metadata elsewhere, in a file written later: the same entry, no conversion
    (tmp_path / "elsewhere").mkdir()
    write_gguf(tmp_path / "elsewhere" / "other.gguf", tiny_llama())
    converted = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: converted.append(k) or real(*a, **k))
    _, _, second, _ = load_gguf(tmp_path / "elsewhere" / "other.gguf", cache=tmp_path / "cache")
    assert [k for k in converted if "gguf_file" in k] == []
    assert list((tmp_path / "cache" / "tokenizers").iterdir()) == saved
    # other metadata (a longer context): its own entry
    model = tiny_llama()
    model.config.max_position_embeddings *= 2
    write_gguf(tmp_path / "longer.gguf", model)
    load_gguf(tmp_path / "longer.gguf", cache=tmp_path / "cache")
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2
    text = "hello world <s> wo</s>\n"
    assert second(text).input_ids == first(text).input_ids
    assert second.chat_template == first.chat_template == CHAT_TEMPLATE
    assert (second.eos_token_id, second.bos_token_id) == (first.eos_token_id, first.bos_token_id)


def test_weights_are_reiterable_and_lazy(tmp_path):
    write_gguf(tmp_path / "m.gguf", tiny_llama(), Q.Q8_0)
    _, weights, _, _ = load_gguf(tmp_path / "m.gguf", cache=tmp_path / "cache")
    first = next(iter(weights))
    assert len(weights) == len(list(weights)) == 2 * 9 + 3
    assert torch.equal(first[1], next(iter(weights))[1])


def test_linear_rope_scaling_reaches_the_config(tmp_path):
    write_gguf(tmp_path / "m.gguf", tiny_llama(), rope_scaling=("linear", 4.0))
    config, *_ = load_gguf(tmp_path / "m.gguf", cache=tmp_path / "cache")
    assert config.rope_parameters == {"rope_type": "linear", "rope_theta": 50000.0, "factor": 4.0}


def test_unsupported_architecture_names_file_and_architecture(tmp_path):
    path = tmp_path / "q.gguf"
    write_gguf(path, tiny_llama(), arch="mamba")
    with pytest.raises(GGUFError, match=r"q\.gguf.*'mamba'.*not supported.*llama.*qwen2"):
        load_gguf(path, cache=tmp_path / "cache")


def test_tensor_type_the_gguf_package_cannot_dequantize_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    block, type_size = GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((4, 64 // block * type_size), dtype=np.uint8)  # a (4, 64) Q8_1 tensor
    write_gguf(path, tiny_llama(), extra_tensors=[("blk.0.attn_v.bias", raw, Q.Q8_1)])
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_v\.bias.*Q8_1"):
        load_gguf(path, cache=tmp_path / "cache")


def test_unknown_tensor_is_an_error(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_llama(), extra_tensors=[("blk.0.ffn_gate_exps.weight", np.ones((2, 8), np.float32), None)])
    with pytest.raises(GGUFError, match="ffn_gate_exps"):
        load_gguf(path, cache=tmp_path / "cache")


def test_non_gguf_file_is_named_in_the_error(tmp_path):
    path = tmp_path / "model.safetensors.gguf"
    path.write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(GGUFError, match=r"model\.safetensors\.gguf: not a readable GGUF file"):
        load_gguf(path, cache=tmp_path / "cache")
