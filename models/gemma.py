"""Gemma 2 and Gemma 3 (text) decoders over a paged KV cache.

Built from Llama's attention (models/llama.py), the shared layers and the shared stack
(models/causal_lm.py, whose switches take Gemma's differences); what differs, all read from the
HF config:

    embeddings   scaled by sqrt(hidden_size), the scale rounded to the activation dtype
    norms        GemmaRMSNorm: x / rms(x) * (1 + w) in float32; four a layer (before and
                 after attention, before and after the MLP)
    MLP          gated, `hidden_activation` (gelu_pytorch_tanh)
    attention    scale query_pre_attn_scalar ** -0.5; sliding-window layers interleaved with
                 global ones (`layer_types`, `sliding_window`); Gemma 2 soft-caps the scores
                 (`attn_logit_softcapping`); Gemma 3 RMS-norms each q and k head
    RoPE         Gemma 3: `rope_parameters` per layer type (local layers their own base,
                 scaling on global layers only), one cos/sin table per type
    logits       soft-capped (`final_logit_softcapping`)

Parameter names follow the HF checkpoints (norm weights as stored: zero-centred), except
q/k/v -> `qkv_proj` and gate/up -> `gate_up_proj`, each one matmul (see models/layers/linear.py).
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import PretrainedConfig

from models.causal_lm import CausalLM, DecoderLayer
from models.config import layer_windows
from models.layers.mlp import GatedMLP
from models.layers.norm import GemmaRMSNorm
from models.layers.rope import RotaryEmbedding
from models.llama import LlamaAttention


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale, score soft-capping and (Gemma 3) q/k norms."""

    def __init__(
        self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, window: int | None, qk_norm: bool
    ) -> None:
        super().__init__(config, rotary_emb, window)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = getattr(config, "attn_logit_softcapping", None) or None
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)


class GemmaDecoderLayer(DecoderLayer):
    """x += post_attention_layernorm(attn(input_layernorm(x)));
    x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))."""

    sandwich_norms = True

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        rotary_embs: dict[str, RotaryEmbedding],
        window: int | None,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]  # which RoPE table this layer reads
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = GemmaAttention(config, rotary_embs[self.layer_type], window, qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.mlp = GatedMLP(size, config.intermediate_size, act)


def _rope_config(hf_config: PretrainedConfig, layer_type: str) -> PretrainedConfig:
    """hf_config as RotaryEmbedding reads it for one layer type: Gemma 3's rope_parameters are
    nested by layer type in transformers 5; a shallow copy carries that type's entry alone."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if not isinstance(params.get(layer_type), dict):
        return hf_config  # one set for every layer (Gemma 2)
    flat = copy.copy(hf_config)
    flat.rope_parameters = dict(params[layer_type])
    return flat


class GemmaForCausalLM(CausalLM):
    serves_sliding_window = True
    qk_norm = False  # Gemma 3 norms q and k per head

    def __init__(self, hf_config: PretrainedConfig, max_model_len: int) -> None:
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (Gemma embedding models) is not supported")
        layer_types = list(hf_config.layer_types)
        tables = {
            kind: RotaryEmbedding(_rope_config(hf_config, kind), max_model_len) for kind in sorted(set(layer_types))
        }
        windows = layer_windows(hf_config)
        super().__init__(
            hf_config,
            nn.ModuleDict(tables),
            lambda i: GemmaDecoderLayer(hf_config, i, tables, windows[i], self.qk_norm),
        )
        self.model.norm = GemmaRMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.model.embed_scale = hf_config.hidden_size**0.5


class Gemma2ForCausalLM(GemmaForCausalLM):
    """HF model_type gemma2: score soft-capping, alternating local / global layers."""


class Gemma3ForCausalLM(GemmaForCausalLM):
    """HF model_type gemma3_text: q/k norms, local RoPE base, rope scaling on global layers."""

    qk_norm = True
