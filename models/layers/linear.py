"""Fused linear layers and copying HF checkpoint tensors into a model.

HF checkpoints store q/k/v (and gate/up) as separate projections of the same
input.  One matmul over their concatenation is faster, so `MergedLinear` keeps
them stacked along the output dim and loads each checkpoint tensor into its rows:

    weight rows:  [ q_proj (H*d) | k_proj (Hk*d) | v_proj (Hk*d) ]
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.quantization import DENSE, LinearMethod, QuantizedWeight
from models.layers.step_kernels import DEFAULT_KERNELS, StepKernels, onednn_takes


class Linear(nn.Module):
    """y = x W^T + b, with W stored and multiplied as its `quant_method` says.

    Dense by default; the loader may give a layer another method before the weights are
    materialized (`set_quant_method`), and a dense bf16 weight may also be held packed in
    oneDNN's layout (`pack_linear_weights`).
    """

    packed_weight: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method: LinearMethod = DENSE
        DENSE.create_weights(self, out_features, in_features)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # nn.Linear's initialization, for layers used without a checkpoint (the loader builds
        # models on the meta device, where this costs nothing, and then fills every weight).
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def set_quant_method(self, method: LinearMethod) -> None:
        """Swap the weight storage for `method`'s (on the meta device, before loading)."""
        if method is self.quant_method:
            return
        old = getattr(self, self.quant_method.weight_names()[0])
        self.compute_dtype = self.quant_method.compute_dtype(self)
        for name in self.quant_method.weight_names():
            delattr(self, name)
        with torch.device(old.device):
            method.create_weights(self, self.out_features, self.in_features)
        self.quant_method = method

    def linear(self, x: torch.Tensor, kernels: StepKernels = DEFAULT_KERNELS) -> torch.Tensor:
        """x W^T + b on the step's `kernels` (AttentionMetadata.kernels); `forward` too,
        except for an Embedding, whose forward looks rows up."""
        return self.quant_method.apply(self, x, self.bias, kernels)

    forward = linear

    def load_weight(self, weight, name: str, rows: slice = slice(None)) -> None:
        """Copy a checkpoint weight (a tensor or a QuantizedWeight) into rows `rows` of W."""
        self.quant_method.load(self, rows, weight, name)

    def weight_param_names(self) -> tuple[str, ...]:
        return self.quant_method.weight_names()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.quant_method.name}")


class Embedding(Linear):
    """Token embeddings in the same storage as a Linear (vocab_size, hidden_size), so that a
    quantized embedding is looked up by dequantizing only the rows asked for, and a tied
    model's logits run through the same method as any other linear layer (`linear`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(embedding_dim, num_embeddings, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.embedding(self, ids)


def can_pack_weights(dtype: torch.dtype, device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and onednn_takes(dtype)


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
        if (
            isinstance(module, Linear)
            and not isinstance(module, Embedding)  # looked up by row: stays plain
            and module.quant_method is DENSE
            and module.packed_weight is None
            and not module.weight.is_mkldnn
        ):
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
            if keep_plain:
                module.packed_weight = packed
            else:
                module.weight = nn.Parameter(packed, requires_grad=False)
            count += 1
    return count


def process_weights_after_loading(model: nn.Module) -> int:
    """Every Linear's method puts its weights in the layout it runs on (quantized layers on CPU:
    the kernel's panels), once, after loading. Returns the number of layers changed."""
    return sum(m.quant_method.process_weights_after_loading(m) for m in model.modules() if isinstance(m, Linear))


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of every Linear's (and Embedding's) stored weight, quantized or not."""
    return sum(
        getattr(m, name).numel() * getattr(m, name).element_size()
        for m in model.modules()
        if isinstance(m, Linear)
        for name in m.weight_param_names()
        if getattr(m, name) is not None  # Q4_0's mins, dropped once made from the scales
    )


class MergedLinear(Linear):
    """One Linear whose output is the concatenation of named HF projections."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets, offset = {}, 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def shard_rows(self, name: str) -> slice:
        """The rows of W (and of the bias) that hold projection `name`."""
        offset = self.shard_offsets[name]
        return slice(offset, offset + self.shard_sizes[name])

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.shard_sizes.values()), dim=-1)


def copy_weight(dst: torch.Tensor, src, name: str) -> None:
    """Copy (and cast to the serving dtype) one checkpoint tensor, refusing shape mismatches."""
    if isinstance(src, QuantizedWeight):  # a norm or router weight stored quantized: rare, small
        src = src.dequantize()
    if dst.shape != src.shape:
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Copy HF-named tensors into `model`; returns the names of the parameters fully loaded.

    A name either names a parameter, or the weight of a `Linear` (which stores it as its
    method says), or is `<parent>.<shard>.<kind>` of a MergedLinear at `<parent>.<merged>`;
    a merged weight counts as loaded once every shard arrived. Unknown names and shape
    mismatches raise ValueError.
    """
    params = dict(model.named_parameters())
    linears: dict[str, Linear] = {}
    merged: dict[str, tuple[str, MergedLinear]] = {}  # "<parent>.q_proj" -> ("<parent>.qkv_proj", module)
    for path, module in model.named_modules():
        if isinstance(module, Linear):
            linears[path] = module
        if isinstance(module, MergedLinear):
            parent = path.rpartition(".")[0]
            for shard in module.shard_sizes:
                merged[f"{parent}.{shard}" if parent else shard] = (path, module)
    loaded: set[str] = set()

    def weight_loaded(path: str, module: Linear) -> None:
        loaded.update(f"{path}.{n}" if path else n for n in module.weight_param_names())

    shards_seen: dict[str, set[str]] = {}
    for name, tensor in weights:
        if skip(name):
            continue
        prefix, _, kind = name.rpartition(".")
        if kind == "weight" and prefix in linears and not isinstance(linears[prefix], MergedLinear):
            linears[prefix].load_weight(tensor, name)
            weight_loaded(prefix, linears[prefix])
            continue
        if name in params:
            copy_weight(params[name], tensor, name)
            loaded.add(name)
            continue
        shard = prefix.rpartition(".")[2]
        if prefix not in merged or kind not in ("weight", "bias") or (kind == "bias" and merged[prefix][1].bias is None):
            raise ValueError(f"tensor {name!r} {tuple(tensor.shape)} does not belong to this model")
        path, module = merged[prefix]
        rows = module.shard_rows(shard)
        if kind == "weight":
            module.load_weight(tensor, name, rows)
        else:
            copy_weight(module.bias[rows], tensor, name)
        seen = shards_seen.setdefault(f"{path}.{kind}", set())
        seen.add(shard)
        if len(seen) == len(module.shard_sizes):
            if kind == "weight":
                weight_loaded(path, module)
            else:
                loaded.add(f"{path}.bias")
    return loaded
