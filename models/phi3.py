"""Phi-3 / Phi-3.5 / Phi-4-mini: a Llama whose checkpoints fuse q/k/v into one `qkv_proj` and
gate/up into one `gate_up_proj` (HF safetensors and llama.cpp's GGUF alike).

Our Llama layers hold the same fused matmuls already (MergedLinear), loaded shard by shard so
that tensor parallel can take each projection's part; the fused tensors are split back into
the HF projections they were made of as they are read, and nothing else differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from models.layers.quantization import QuantizedWeight
from models.llama import LlamaForCausalLM, _head_dim


class Phi3ForCausalLM(LlamaForCausalLM):
    # checkpoint tensor -> the projections it holds, in row order (the loader reads their types from it)
    fused_checkpoint_tensors = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> set[str]:
        return super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> Iterator[tuple]:
        c = self.hf_config
        d = _head_dim(c)
        kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * d
        sizes = {
            "q_proj": c.num_attention_heads * d,
            "k_proj": kv,
            "v_proj": kv,
            "gate_proj": c.intermediate_size,
            "up_proj": c.intermediate_size,
        }
        parts = {
            fused: tuple((shard, sizes[shard]) for shard in shards)
            for fused, shards in self.fused_checkpoint_tensors.items()
        }
        for name, tensor in weights:
            prefix, _, kind = name.rpartition(".")
            fused = next((f for f in parts if prefix.endswith(f".{f}")), None)
            if fused is None:
                yield name, tensor
                continue
            shard_sizes = parts[fused]
            if tensor.shape[0] != sum(size for _, size in shard_sizes):
                raise ValueError(
                    f"tensor {name!r}: {tensor.shape[0]} rows, expected "
                    f"{' + '.join(str(size) for _, size in shard_sizes)}"
                )
            parent, start = prefix[: -len(fused) - 1], 0
            for shard, size in shard_sizes:
                rows = slice(start, start + size)
                part = tensor.rows(rows) if isinstance(tensor, QuantizedWeight) else tensor[rows]
                yield f"{parent}.{shard}.{kind}", part
                start += size
