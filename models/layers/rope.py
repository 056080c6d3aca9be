"""Rotary position embeddings with a precomputed cos/sin table indexed by position.

Frequencies come from transformers' own `ROPE_INIT_FUNCTIONS` (default, linear,
dynamic-NTK, YaRN, llama3, ...), so every scaling variant matches the reference
bit for bit instead of being re-derived here.

Dynamic NTK: transformers rescales `inv_freq` from the longest position in the
current batch, which a paged cache cannot follow (cached keys were rotated at
older scales).  Up to `max_position_embeddings` both use the unscaled
frequencies; beyond it we use the frequencies for the table's full length, a
fixed scale like vLLM's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.layers import cpu_kernels


def _default_inv_freq(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    params = config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


def rope_frequencies(config: PretrainedConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq (rotary_dim // 2,), attention_scaling) for an HF config. `rope_freq_factors`
    (GGUF's rope_freqs, how Llama 3.x files store their scaling): divisors of each frequency."""
    inv_freq, scaling = _rope_frequencies(config, max_positions)
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        factors = torch.tensor(factors, dtype=inv_freq.dtype)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freq_factors has {factors.numel()} values for {inv_freq.numel()} frequencies")
        inv_freq = inv_freq / factors
    return inv_freq, scaling


def _rope_frequencies(config: PretrainedConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    config.standardize_rope_params()
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        return _default_inv_freq(config)
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    if rope_type == "dynamic" and max_positions > config.max_position_embeddings:
        return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=max_positions)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k of shape (num_tokens, num_heads, rotary_dim).

    `interleaved=True` rotates adjacent pairs (x0, x1), (x2, x3), ... as DeepSeek's
    checkpoints expect; otherwise the two halves of the head are paired (Llama).

    The model gathers `cos_sin(positions)` once per step (models/causal_lm.py) and each
    layer calls `rotate`, instead of indexing the table 2 * num_layers times.
    """

    def __init__(self, config: PretrainedConfig, max_positions: int, interleaved: bool = False):
        super().__init__()
        # Real CPU tensors even when the model is being built on the meta device.
        with torch.device("cpu"):
            inv_freq, attention_scaling = rope_frequencies(config, max_positions)
            # Same float ops as transformers' forward: position * inv_freq, then cos/sin, then scale.
            freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, rotary_dim)
        self.rotary_dim = 2 * inv_freq.numel()
        self.interleaved = interleaved
        # Plain attributes, not buffers: the table stays float32 whatever dtype the model is cast to.
        self.cos = emb.cos() * attention_scaling
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi] exactly (a sign flip is
        # exact), and one roll is cheaper than chunk + neg + cat.
        sin = emb.sin() * attention_scaling
        half = self.rotary_dim // 2
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for these positions, each (num_tokens, 1, rotary_dim) in `dtype`."""
        if self.cos.device != positions.device:
            self.cos, self.signed_sin = self.cos.to(positions.device), self.signed_sin.to(positions.device)
        cos = self.cos[positions].to(dtype)[:, None, :]  # (num_tokens, 1, rotary_dim)
        sin = self.signed_sin[positions].to(dtype)[:, None, :]
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (num_tokens, num_heads, rotary_dim) with cos/sin from `cos_sin`."""
        if self.interleaved:
            # (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): pairs become halves.
            shape = x.shape
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).reshape(shape)
        elif x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1 and cpu_kernels.available():
            return cpu_kernels.rope_neox(x, cos, sin)  # the formula below in one pass (float32: same values)
        # Same op order as transformers (x * cos + rotate_half(x) * sin) for bit-equal bf16.
        return x * cos + x.roll(self.rotary_dim // 2, dims=-1) * sin
