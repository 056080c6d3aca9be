"""Every registered architecture is one CausalLM: the same forward, logits, cache spec and
decoder stack, its layers called with one signature; a model class only builds its layers."""

from __future__ import annotations

import pytest
import torch
import transformers

from models.causal_lm import CausalLM, DecoderLayer, DecoderModel
from models.registry import MODEL_REGISTRY, get_model_class

_TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)
_MLA = dict(
    kv_lora_rank=24,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    q_lora_rank=None,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=16,
    first_k_dense_replace=1,
)
CONFIGS = {  # architecture -> (transformers config class, extra fields)
    "LlamaForCausalLM": ("LlamaConfig", dict(num_key_value_heads=2)),
    "MistralForCausalLM": ("MistralConfig", dict(num_key_value_heads=2)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=32)),
    "Qwen2MoeForCausalLM": (
        "Qwen2MoeConfig",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        ),
    ),
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        dict(
            num_key_value_heads=1,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            mlp_only_layers=[0],
        ),
    ),
    "Phi3ForCausalLM": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=0)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", _MLA),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", dict(_MLA, tie_word_embeddings=True)),
}


def test_every_registered_architecture_has_a_tiny_config_here():
    assert set(CONFIGS) == set(MODEL_REGISTRY)


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_each_model_is_the_one_interface_with_one_layer_signature(architecture):
    config_cls, extra = CONFIGS[architecture]
    hf_config = getattr(transformers, config_cls)(**_TINY, **extra)
    cls = get_model_class(architecture)
    with torch.device("meta"):
        model = cls(hf_config, 64)
    assert isinstance(model, CausalLM) and type(model.model) is DecoderModel
    for name in ("forward", "compute_logits", "kv_cache_spec"):
        assert getattr(cls, name) is getattr(CausalLM, name), f"{cls.__name__} overrides {name}"
    assert all(
        isinstance(layer, DecoderLayer) and type(layer).forward is DecoderLayer.forward for layer in model.model.layers
    )
    assert (model.lm_head is None) == bool(extra.get("tie_word_embeddings", False))
    spec = model.kv_cache_spec(torch.bfloat16)
    assert spec.num_layers == 2
    if "kv_lora_rank" in extra:  # MLA: one latent per token, shared by all heads
        assert spec.entry_shape == (extra["kv_lora_rank"] + extra["qk_rope_head_dim"],)
    else:  # GQA: K and V of each KV head
        head_dim = extra.get("head_dim", _TINY["hidden_size"] // _TINY["num_attention_heads"])
        assert spec.entry_shape == (2, extra["num_key_value_heads"], head_dim)
