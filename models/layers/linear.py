"""Fused linear layers and copying HF checkpoint tensors into a model.

HF checkpoints store q/k/v (and gate/up) as separate projections of the same
input.  One matmul over their concatenation is faster, so `MergedLinear` keeps
them stacked along the output dim and loads each checkpoint tensor into its rows:

    weight rows:  [ q_proj (H*d) | k_proj (Hk*d) | v_proj (Hk*d) ]
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear that can also hold its weight packed in oneDNN's layout (`pack_linear_weights`)."""

    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight
        if packed is None and self.weight.is_mkldnn:
            packed = self.weight
        # One row with oneDNN switched off (the runner does that for single-token steps,
        # engine/threads.py): torch's own gemv over the plain weight, when one is kept.
        if packed is not None and (packed is self.weight or x.shape[0] > 1 or torch.backends.mkldnn.enabled):
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_pack_weights(dtype: torch.dtype, device: torch.device | str) -> bool:
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_linear_weights(model: nn.Module, keep_plain: bool = False) -> int:
    """Store the weight of every `Linear` in oneDNN's blocked layout, once, after loading.

    A bf16 F.linear on CPU hands oneDNN a plain row-major weight, which it reorders into
    its own layout on every call; a packed weight skips that, with bit-identical results.
    30 layers of SmolLM2's linears, 2 threads: 64 rows 52.7 -> 41.2 ms (a whole step of
    64 decodes: 138 -> 98 ms), 300 rows about even. What inductor's CPU freezing does,
    without compiling. For one row torch's own gemv over the plain weight is faster still
    (9-10 ms vs 13 ms): `keep_plain` keeps both (twice the memory) for single-token steps.
    Otherwise the packed tensor replaces the plain one. Checkpoint loading must be done by
    then. Returns the number of weights packed.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed_weight is None and not module.weight.is_mkldnn:
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
            if keep_plain:
                module.packed_weight = packed
            else:
                module.weight = nn.Parameter(packed, requires_grad=False)
            count += 1
    return count


def linear_weight_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, Linear))


class MergedLinear(Linear):
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
