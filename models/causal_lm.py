"""What every model class shares: the interface the loader and the runner use.

    forward(input_ids, positions, kv_caches, attn_metadata) -> hidden (num_tokens, hidden_size)
    compute_logits(hidden) -> (num_rows, vocab_size) float32
    kv_cache_spec(dtype) -> KVCacheSpec           what one token stores per layer
    load_weights(weights) -> set of parameter names filled

Subclasses build `self.model` (with `embed_tokens`, an Embedding) and `self.lm_head` (a
Linear, or None when the checkpoint ties it to the embedding). Both are Linear layers
underneath, so a quantized checkpoint's embedding and logits run through the same
per-layer method as every other projection (models/layers/quantization.py).
"""
from __future__ import annotations

import torch
from torch import nn

from models.layers.linear import Linear


class CausalLM(nn.Module):
    model: nn.Module
    lm_head: Linear | None

    def init_lm_head(self, hf_config) -> None:
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Tied: logits reuse the embedding's storage; a second Parameter sharing it would
        # come apart when the loader moves the model off the meta device.
        self.lm_head = None if self.tie_word_embeddings else Linear(hf_config.hidden_size, hf_config.vocab_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.linear(hidden).float()  # (num_rows, vocab_size)

    def skips_weight(self, name: str) -> bool:
        """Checkpoint tensors that are not parameters: old checkpoints store RoPE's inv_freq;
        tied ones sometimes still carry lm_head."""
        return name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight")
