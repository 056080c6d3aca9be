"""Qwen2-MoE and Qwen3-MoE: the Llama-family decoder (models/llama.py's attention: Qwen2's q/k/v
biases, Qwen3's q/k norms) with a mixture of experts (models/layers/moe.py) for the MLP on its
sparse layers.

    MLP of layer i = MoE   if (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
                     dense SwiGLU (intermediate_size) otherwise
    router         = softmax over all experts in float32, top-k, renormalised if norm_topk_prob
    Qwen2-MoE      + one shared expert on every token, scaled by sigmoid(shared_expert_gate(x))

Checkpoints (and PEFT adapters) name the shared expert `mlp.shared_expert.*`; it is the MoE's
`shared_experts` here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from transformers import PretrainedConfig

from models.causal_lm import CausalLM, DecoderLayer
from models.config import layer_windows
from models.layers.linear import load_hf_weights
from models.layers.mlp import GatedMLP
from models.layers.moe import MoE, RouterConfig, load_expert_weight
from models.layers.norm import RMSNorm
from models.layers.quantization import QuantizedWeight
from models.layers.rope import RotaryEmbedding
from models.llama import LlamaAttention

_SHARED_EXPERT = re.compile(r"\.mlp\.shared_expert\.")


def is_moe_layer(hf_config: PretrainedConfig, layer_idx: int) -> bool:
    """transformers' rule (Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer)."""
    step = hf_config.decoder_sparse_step or 1
    return (
        hf_config.num_experts > 0 and (layer_idx + 1) % step == 0 and layer_idx not in (hf_config.mlp_only_layers or ())
    )


class QwenMoeDecoderLayer(DecoderLayer):
    def __init__(
        self,
        hf_config: PretrainedConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        window: int | None,
        router_config: RouterConfig,
    ):
        super().__init__()
        c = hf_config
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = LlamaAttention(c, rotary_emb, window)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if is_moe_layer(c, layer_idx):
            shared = getattr(c, "shared_expert_intermediate_size", 0) or 0  # Qwen3-MoE has none
            self.mlp = MoE(
                c.hidden_size,
                c.moe_intermediate_size,
                c.hidden_act,
                router_config,
                shared_intermediate_size=shared,
                shared_gate=bool(shared),
                shared_name="shared_expert",
            )
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


class QwenMoeForCausalLM(CausalLM):
    serves_sliding_window = True  # LlamaAttention attends within each layer's window

    def __init__(self, hf_config: PretrainedConfig, max_model_len: int):
        c = hf_config
        router_config = RouterConfig.softmax_top_k(c.num_experts, c.num_experts_per_tok, bool(c.norm_topk_prob))
        rotary_emb = RotaryEmbedding(c, max_model_len)
        windows = layer_windows(c)
        super().__init__(
            c,
            rotary_emb,
            lambda layer_idx: QwenMoeDecoderLayer(c, layer_idx, rotary_emb, windows[layer_idx], router_config),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> set[str]:
        """Routed experts per expert or fused (models/layers/moe.py's load_expert_weight); the rest as
        plain or merged parameters (models/layers/linear.py)."""
        loaded: set[str] = set()

        def load_expert(name: str, tensor: torch.Tensor | QuantizedWeight) -> bool:
            done = load_expert_weight(self, name, tensor)
            loaded.update(done or ())
            return done is not None

        plain = (
            (_SHARED_EXPERT.sub(".mlp.shared_experts.", n), t)
            for n, t in weights
            if not self.skips_weight(n) and not load_expert(n, t)
        )
        loaded |= load_hf_weights(self, plain)
        return loaded
