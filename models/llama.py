"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

One class serves all four; their differences are a few config switches:

    Qwen2   q/k/v projections carry a bias (o_proj does not)
    Qwen3   RMSNorm over each q and k head before RoPE; explicit head_dim
    Llama   `attention_bias` / `mlp_bias` flags; RoPE scaling via rope_parameters
    Mistral sliding window on every layer (Qwen2/3: on the layers `layer_types` marks), in paged attention

Qwen2-MoE and Qwen3-MoE (models/qwen_moe.py) share this attention.

Parameter names follow the HF checkpoints, except q/k/v -> `qkv_proj` and
gate/up -> `gate_up_proj`, each one matmul (see models/layers/linear.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from models.causal_lm import CausalLM, DecoderLayer
from models.config import layer_windows
from models.layers import cpu_kernels
from models.layers import parallel as tp_state
from models.layers.attention import AttentionMetadata, kernel_serves, paged_attention
from models.layers.linear import Linear, MergedLinear
from models.layers.mlp import GatedMLP
from models.layers.norm import RMSNorm
from models.layers.quantization import QuantMethod
from models.layers.rope import RotaryEmbedding


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Tensor parallel (models/layers/parallel.py): a rank holds num_heads / N query heads and
    their KV heads (replicated when N exceeds them), q/k/v column-parallel, o_proj row-parallel;
    num_heads and num_kv_heads are then this rank's. window: the layer's sliding window (None: full)."""

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.softcap: float | None = None  # scores soft-capped before the softmax (Gemma 2)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} not a multiple of num_key_value_heads {num_kv_heads}")
        tp = tp_state.current()
        heads, kv_heads = tp.split(num_heads, "num_attention_heads"), tp_state.kv_head_slice(num_kv_heads, tp)
        self.num_heads, self.num_kv_heads = heads.stop - heads.start, kv_heads.stop - kv_heads.start
        self.head_dim = _head_dim(config)
        self.scale = self.head_dim**-0.5
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = config.model_type in ("qwen2", "qwen2_moe")  # Qwen2-MoE: biases unless qkv_bias=False
        d = self.head_dim
        kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q_proj": num_heads * d, "k_proj": num_kv_heads * d, "v_proj": num_kv_heads * d},
            bias=attention_bias or (is_qwen2 and getattr(config, "qkv_bias", True)),
            parallel="column",
            shard_parts={"q_proj": slice(heads.start * d, heads.stop * d), "k_proj": kv_rows, "v_proj": kv_rows},
        )
        o_bias = attention_bias and not is_qwen2  # Qwen2: biases on q/k/v only
        self.o_proj = Linear(num_heads * d, config.hidden_size, bias=o_bias, parallel="row")
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm: nn.Module = RMSNorm(self.head_dim, eps=config.rms_norm_eps)  # Gemma's: GemmaRMSNorm
            self.k_norm: nn.Module = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        if rotary_emb.rotary_dim != self.head_dim:
            raise ValueError(
                f"partial rotary embeddings are not supported (rotary dim {rotary_emb.rotary_dim}, "
                f"head_dim {self.head_dim})"
            )
        self.rotary_emb = rotary_emb  # shared by all layers; holds no parameters
        # An int8 cache stores (k - key_offset) * key_scale and its queries read it as q * query_scale
        # (key_scale's inverse, by KV head); calibrated per channel by models/kv_int8.py, float32.
        self.key_offset: torch.Tensor | None = None  # (Hk, head_dim)
        self.key_scale: torch.Tensor | None = None  # (Hk, head_dim)
        self.query_scale: torch.Tensor | None = None  # (H, head_dim)

    def int8_keys(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """(key_offset, key_scale, query_scale) for the keys and queries of `kv_cache`: the calibrated
        ones for an int8 cache, else None each. The softmax takes q . offset out of every score of a
        query, but soft-capped scores would keep it: those layers store no offset."""
        if kv_cache.dtype != torch.int8:
            return None, None, None
        return None if self.softcap is not None else self.key_offset, self.key_scale, self.query_scale

    @property
    def kv_entry_shape(self) -> tuple[int, ...]:
        """What one token stores in this layer's cache: K and V for each KV head."""
        return (2, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """rope: (cos, sin) of the step's positions from RotaryEmbedding.cos_sin, shared by all layers."""
        num_tokens = x.shape[0]
        H, Hk = self.num_heads, self.num_kv_heads
        kernels = attn_metadata.kernels
        qkv = self.qkv_proj(x, kernels).view(num_tokens, H + 2 * Hk, self.head_dim)  # (num_tokens, H + 2 Hk, head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qkv[:, :H]), self.k_norm(qkv[:, H : H + Hk])), dim=1)
        else:
            qk = qkv[:, : H + Hk]
        # q and k heads are adjacent in the qkv output: rotate them in one pass.
        qk = self.rotary_emb.rotate(qk, *rope)  # (num_tokens, H + Hk, head_dim)
        q, k = qk[:, :H], qk[:, H:]
        offset, key_scale, query_scale = self.int8_keys(kv_cache)
        if offset is not None:
            k = k - offset
        if key_scale is not None and query_scale is not None:  # csrc/decoder_layer.cpp: the same ops
            k, q = k * key_scale, q * query_scale
        out = paged_attention(
            q,
            k,
            qkv[:, H + Hk :],
            kv_cache,
            attn_metadata,
            self.scale,
            window=self.window,
            softcap=self.softcap,
        )
        return self.o_proj(out.reshape(num_tokens, H * self.head_dim), kernels)  # (num_tokens, H * head_dim)


# csrc/decoder_layer.cpp's per-layer arguments: input and post-attention norm weights, eps, the
# projections' [qweight, scales, mins, bias] x 4 and [bits, group size, out features, min per scale] x 4,
# and (heads, KV heads, head dim).
_OneOpLayer = tuple[torch.Tensor, torch.Tensor, float, list[torch.Tensor | None], list[int], tuple[int, int, int]]


class LlamaDecoderLayer(DecoderLayer):
    input_layernorm: RMSNorm
    self_attn: LlamaAttention
    post_attention_layernorm: RMSNorm
    mlp: GatedMLP

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary_emb, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=mlp_bias)
        self._one_op: tuple | None = None  # the one-op form's weight arguments, once known
        self._lora_linears: tuple[Linear, ...] | None = None  # one_op_lora's four layers, once looked up

    @staticmethod
    def call_one_op(
        x: torch.Tensor,
        args: tuple,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        lora: tuple | None = None,
    ) -> torch.Tensor:
        # The same kernels in the same order as the modules below, in one call: bit-identical
        # results without ~14 ops' worth of Python and dispatch (csrc/decoder_layer.cpp; with an
        # adapter's rows, csrc/lora_ops.cpp).
        layer: _OneOpLayer
        layer, scale, window, attn = args
        meta = attn_metadata
        int8_keys = attn.int8_keys(kv_cache)
        if lora is not None:
            assert int8_keys[1] is None, "the adapters' one op writes keys as they are (one_op_lora)"
            return torch.ops.pagedserve.llama_decoder_layer_lora(
                x,
                *layer,
                *rope,
                kv_cache,
                meta.slot_mapping,
                meta.block_table,
                meta.seq_lens,
                meta.query_start,
                scale,
                window if window is not None else 0,
                *lora,
            )
        return cpu_kernels.llama_decoder_layer(
            x,
            *layer,
            *rope,
            kv_cache,
            meta.slot_mapping,
            meta.block_table,
            meta.seq_lens,
            meta.query_start,
            scale,
            window,
            *int8_keys,
        )

    def one_op_args(self, x: torch.Tensor, kv_cache: torch.Tensor) -> tuple | None:
        """The arguments of csrc/decoder_layer.cpp that do not change from step to step (norm weights,
        eps, projection weights and their info, head counts; and the scale), when this step can run
        the layer as one op: float32 on CPU, every projection on the quantized kernel, a plain
        Llama/Qwen2 layer. Gathered once: read through the modules' attributes at every call, the
        Python around a 360M layer's op took 8.5 us, now 5.4 (timeit, Zen 5; ~0.1 ms a token)."""
        if x.dtype != torch.float32 or not kernel_serves(x.unsqueeze(1), kv_cache):
            return None
        if self._one_op is None:  # the kernels are loaded by now (kernel_serves)
            self._one_op = self._gather_one_op_args() or ()
        return self._one_op or None

    def one_op_lora(self, slot: int) -> tuple | None:
        """Per projection (qkv, o, gate_up, down) the adapter's A_cat and B_cat^T (None, None where
        it adds nothing), its blocks ([count, then o, n, c, r each]) and scale: as the modules add it."""
        if not hasattr(torch.ops.pagedserve, "llama_decoder_layer_lora") or self.self_attn.key_scale is not None:
            return None  # (its op writes keys as they come: with an int8 cache's scales, module by module)
        if self._lora_linears is None:  # at every step of every layer: no nn.Module lookups
            attn, mlp = self.self_attn, self.mlp
            self._lora_linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        tensors: list[torch.Tensor | None] = []
        blocks: list[int] = []
        scales: list[float] = []
        for linear in self._lora_linears:
            found = None if linear.lora is None else linear.lora.slots.get(slot)
            if found is None:
                tensors += [None, None]
                blocks.append(0)
                scales.append(0.0)
            else:
                tensors += [found.a, found.bt]
                blocks += [len(found.blocks) // 4, *found.blocks]
                scales.append(found.scale)
        return tensors, blocks, scales

    def _gather_one_op_args(self) -> tuple | None:
        attn = self.self_attn
        if attn.o_proj.parallel:  # tensor parallel: all-reduces inside the layer
            return None
        found = self._weights_for_one_op()
        if found is None:
            return None
        weights, info = found
        norm = self.input_layernorm
        layer = (
            norm.weight,
            self.post_attention_layernorm.weight,
            norm.eps,
            weights,
            info,
            (attn.num_heads, attn.num_kv_heads, attn.head_dim),
        )
        return layer, attn.scale, attn.window, attn

    def _weights_for_one_op(self) -> tuple | None:
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if (
            attn.qk_norm
            or attn.rotary_emb.interleaved
            or not mlp.is_silu
            or not hasattr(torch.ops.pagedserve, "llama_decoder_layer")
            or self.input_layernorm.weight.dtype != torch.float32
        ):
            return None
        weights: list[torch.Tensor | None] = []
        info: list[int] = []
        for linear in linears:
            method = linear.quant_method
            if not (
                isinstance(method, QuantMethod)
                and method.quantize_input
                and method.process_weights_after_loading(linear)
            ):
                return None
            # The method's parameters and attributes, which it sets on the layer (quantization.py).
            scales = linear.get_parameter("scales")
            weights += [linear.get_parameter("qweight"), scales, getattr(linear, "mins", None), linear.bias]
            info += [
                method.kernel_bits,
                linear.in_features // scales.shape[1],
                linear.out_features,
                int(getattr(linear, "min_per_scale")),
            ]
        return weights, info


class LlamaForCausalLM(CausalLM):
    serves_sliding_window = True  # every sliding layer attends within its window: no cap on max_model_len

    def __init__(self, hf_config: PretrainedConfig, max_model_len: int) -> None:
        rotary_emb = RotaryEmbedding(hf_config, max_model_len)
        windows = layer_windows(hf_config)
        super().__init__(
            hf_config, rotary_emb, lambda layer_idx: LlamaDecoderLayer(hf_config, rotary_emb, windows[layer_idx])
        )
