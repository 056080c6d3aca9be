"""Fused linear layers and copying HF checkpoint tensors into a model.

HF checkpoints store q/k/v (and gate/up) as separate projections of the same
input.  One matmul over their concatenation is faster, so `MergedLinear` keeps
them stacked along the output dim and loads each checkpoint tensor into its rows:

    weight rows:  [ q_proj (H*d) | k_proj (Hk*d) | v_proj (Hk*d) ]
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One nn.Linear whose output is the concatenation of named HF projections."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets, offset = {}, 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def shard(self, name: str, kind: str) -> torch.Tensor:
        """View of the rows of `kind` ("weight"/"bias") that hold projection `name`."""
        param = getattr(self, kind)
        return param.narrow(0, self.shard_offsets[name], self.shard_sizes[name])

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.shard_sizes.values()), dim=-1)


def copy_weight(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy (and cast to the serving dtype) one checkpoint tensor, refusing shape mismatches."""
    if dst.shape != src.shape:
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Copy HF-named tensors into `model`; returns the names of the parameters fully loaded.

    A name either matches a parameter directly or is `<parent>.<shard>.<kind>` of a
    MergedLinear at `<parent>.<merged>`; a merged parameter counts as loaded once
    every shard arrived.  Unknown names and shape mismatches raise ValueError.
    """
    params = dict(model.named_parameters())
    merged: dict[str, tuple[str, MergedLinear]] = {}  # "<parent>.q_proj" -> ("<parent>.qkv_proj", module)
    for path, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = path.rpartition(".")[0]
            for shard in module.shard_sizes:
                merged[f"{parent}.{shard}" if parent else shard] = (path, module)
    loaded: set[str] = set()
    shards_seen: dict[str, set[str]] = {}
    with torch.no_grad():
        for name, tensor in weights:
            if skip(name):
                continue
            if name in params:
                copy_weight(params[name], tensor, name)
                loaded.add(name)
                continue
            prefix, _, kind = name.rpartition(".")
            shard = prefix.rpartition(".")[2]
            if prefix not in merged or kind not in ("weight", "bias") or getattr(merged[prefix][1], kind) is None:
                raise ValueError(f"tensor {name!r} {tuple(tensor.shape)} does not belong to this model")
            path, module = merged[prefix]
            copy_weight(module.shard(shard, kind), tensor, name)
            seen = shards_seen.setdefault(f"{path}.{kind}", set())
            seen.add(shard)
            if len(seen) == len(module.shard_sizes):
                loaded.add(f"{path}.{kind}")
    return loaded
