"""DeepSeek V2 / V3: multi-head latent attention (models/layers/mla.py) and a
mixture of experts (models/layers/moe.py) in a pre-norm decoder.

    embed -> [ x += MLA(norm(x)) ; x += FFN(norm(x)) ] * num_layers -> norm -> lm_head
    FFN = dense SwiGLU in the first `first_k_dense_replace` layers, MoE after
          (every `moe_layer_freq`-th layer when the config sets it)

V2 and V3 differ only in routing (softmax vs sigmoid + correction bias, see moe.py) and
in V3's `rope_interleave` switch; V2 checkpoints always store rope dims in interleaved
pairs. Unlike transformers 5.23's V2 router, which ignores `norm_topk_prob`, both
renormalise when it is set (as V3 does); released V2 checkpoints leave it False.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from models.causal_lm import CausalLM, DecoderLayer
from models.layers.linear import load_hf_weights
from models.layers.mla import MLAttention
from models.layers.mlp import GatedMLP
from models.layers.moe import MoE, RouterConfig, load_expert_weight
from models.layers.norm import RMSNorm
from models.layers.quantization import QuantizedWeight
from models.layers.rope import RotaryEmbedding

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def is_moe_layer(hf_config: PretrainedConfig, layer_idx: int) -> bool:
    freq = getattr(hf_config, "moe_layer_freq", 1) or 1
    return bool(hf_config.n_routed_experts) and layer_idx >= hf_config.first_k_dense_replace and layer_idx % freq == 0


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(
        self,
        hf_config: PretrainedConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        router_config: RouterConfig | None,
    ) -> None:
        super().__init__()
        c = hf_config
        self.self_attn = MLAttention(c, rotary_emb)
        if router_config is not None and is_moe_layer(c, layer_idx):
            self.mlp = MoE(
                c.hidden_size,
                c.moe_intermediate_size,
                c.hidden_act,
                router_config,
                shared_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
                mlp_bias=getattr(c, "mlp_bias", False),
            )
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=getattr(c, "mlp_bias", False))
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class _DeepseekForCausalLM(CausalLM):
    # (scoring, topk_method) when config.json does not name them; see moe.py.
    router_defaults: tuple[str, str]

    def __init__(self, hf_config: PretrainedConfig, max_model_len: int):
        c = hf_config
        if c.q_lora_rank is not None and c.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be None or >= 1, got {c.q_lora_rank}")
        if min(c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) < 1:
            raise ValueError("kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim must be >= 1")
        router_config = RouterConfig.from_hf(c, *self.router_defaults) if c.n_routed_experts else None
        rotary_emb = RotaryEmbedding(c, max_model_len, interleaved=self.rope_interleaved(c))
        super().__init__(c, rotary_emb, lambda layer_idx: DeepseekDecoderLayer(c, layer_idx, rotary_emb, router_config))

    @staticmethod
    def rope_interleaved(hf_config: PretrainedConfig) -> bool:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> set[str]:
        """Copy HF-named tensors in; returns the parameter names fully loaded.

        Routed experts come per expert (`experts.N.gate_proj.weight`: what save_pretrained
        and DeepSeek's releases write) or fused (`experts.gate_up_proj`, `experts.down_proj`);
        each `kv_b_proj.weight` is split into the attention's W_UK / W_UV. Everything else
        is a plain or merged (gate/up) parameter: see models/layers/linear.py.
        """
        loaded: set[str] = set()

        def load_special(name: str, tensor: torch.Tensor | QuantizedWeight) -> bool:
            if (done := load_expert_weight(self, name, tensor)) is not None:
                loaded.update(done)
                return True
            if name.endswith(".kv_b_proj.weight"):
                prefix = name.removesuffix(".kv_b_proj.weight")
                attention = self._submodule(prefix, name)
                if not isinstance(attention, MLAttention) or isinstance(tensor, QuantizedWeight):
                    raise ValueError(f"tensor {name!r}: expected a dense kv_b_proj of an MLA attention")
                attention.load_kv_b_proj(tensor)
                loaded.update((f"{prefix}.w_uk", f"{prefix}.w_uv"))
                return True
            return False

        plain = ((n, t) for n, t in weights if not self.skips_weight(n) and not load_special(n, t))
        loaded |= load_hf_weights(self, plain)
        return loaded

    def _submodule(self, prefix: str, name: str) -> nn.Module:
        try:
            return self.get_submodule(prefix)
        except AttributeError:
            raise ValueError(f"tensor {name!r} does not belong to this model") from None

    def skips_weight(self, name: str) -> bool:
        if super().skips_weight(name):
            return True
        # V3 checkpoints append multi-token-prediction layers after the last decoder layer.
        m = _LAYER_INDEX.match(name)
        return m is not None and int(m[1]) >= len(self.model.layers)


class DeepseekV2ForCausalLM(_DeepseekForCausalLM):
    router_defaults = ("softmax", "greedy")

    @staticmethod
    def rope_interleaved(hf_config: PretrainedConfig) -> bool:
        return True  # transformers rotates V2's rope dims as complex pairs (x0 + i x1), ...


class DeepseekV3ForCausalLM(_DeepseekForCausalLM):
    router_defaults = ("sigmoid", "noaux_tc")

    @staticmethod
    def rope_interleaved(hf_config: PretrainedConfig) -> bool:
        return bool(getattr(hf_config, "rope_interleave", True))
