"""Fused linear layers and copying HF checkpoint tensors into a model.

HF checkpoints store q/k/v (and gate/up) as separate projections of the same
input.  One matmul over their concatenation is faster, so `MergedLinear` keeps
them stacked along the output dim and loads each checkpoint tensor into its rows:

    weight rows:  [ q_proj (H*d) | k_proj (Hk*d) | v_proj (Hk*d) ]
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

from models.layers import parallel as tp_state
from models.layers.quantization import DENSE, LinearMethod, QuantizedWeight
from models.layers.step_kernels import DEFAULT_KERNELS, StepKernels, onednn_takes

if TYPE_CHECKING:
    from models.layers.lora_weights import LoRAWeights

PARALLEL_MODES = (None, "column", "row")
Checkpoint = torch.Tensor | QuantizedWeight  # a checkpoint tensor, as stored or quantized


class Linear(nn.Module):
    """y = x W^T + b, with W stored and multiplied as its `quant_method` says.

    Dense by default; the loader may give a layer another method before the weights are
    materialized (`set_quant_method`), and a dense bf16 weight may also be held packed in
    oneDNN's layout (`pack_linear_weights`).

    `parallel`: "column" or "row" splits the layer over the tensor-parallel ranks it is
    built for (models/layers/parallel.py); `in_features`/`out_features` are then this
    rank's, and loading takes this rank's part of each checkpoint tensor. A row-parallel
    layer adds its ranks' partial sums with one all-reduce, unless `reduce` is False (the
    caller reduces a sum of several, as MoE does).
    """

    weight: torch.Tensor  # the dense method's; other methods hold theirs (quant_method.weight_names())
    packed_weight: torch.Tensor | None = None
    lora: LoRAWeights | None = None  # its LoRA adapters (models/layers/lora.py); None: none touches it

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, parallel: str | None = None, reduce: bool = True
    ):
        super().__init__()
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        self.tp = tp_state.current() if parallel else tp_state.SINGLE
        self.parallel = parallel if self.tp.enabled else None
        self.reduce = reduce
        # This rank's output rows / input columns of the checkpoint's weight.
        self.out_part, self.in_part = slice(0, out_features), slice(0, in_features)
        if self.parallel == "column":
            self.out_part = self.tp.split(out_features, "the output features of a column-parallel layer")
        elif self.parallel == "row":
            self.in_part = self.tp.split(in_features, "the input features of a row-parallel layer")
        self.checkpoint_in_features = in_features  # the checkpoint's (whole) weight: (out, in)
        self.checkpoint_out_features = out_features
        in_features, out_features = _length(self.in_part), _length(self.out_part)
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
        if self.parallel != "row":
            out = self.quant_method.apply(self, x, self.bias, kernels)
            return out if self.lora is None else self.lora.apply(x, out, kernels.lora)
        partial = self.quant_method.apply(self, x, self.bias if self.tp.rank == 0 else None, kernels)
        if self.lora is not None:  # this rank's columns of A: its share of B(A x), added up by the all-reduce
            partial = self.lora.apply(x, partial, kernels.lora)
        return self.tp.all_reduce(partial) if self.reduce else partial

    forward = linear

    def load_weight(
        self, weight: Checkpoint, name: str, rows: slice = slice(None), part: tuple[slice, int] | None = None
    ) -> None:
        """Copy a checkpoint weight (a tensor or a QuantizedWeight) into rows `rows` of W:
        this rank's part of it (`part`: its output rows in `weight` and the rows `weight`
        has; default `out_part` of the layer's checkpoint rows)."""
        self.quant_method.load(self, rows, self.rank_part(weight, name, part), name)

    def load_bias(
        self, bias: Checkpoint, name: str, rows: slice = slice(None), part: tuple[slice, int] | None = None
    ) -> None:
        if self.bias is None:
            raise ValueError(f"tensor {name!r}: the layer has no bias")
        if self.parallel == "column" or part is not None:
            own, num_rows = part or (self.out_part, self.checkpoint_out_features)
            bias = _narrow_rows(bias, own, num_rows, name)
        copy_weight(self.bias[rows], bias, name)

    def rank_part(self, weight: Checkpoint, name: str, part: tuple[slice, int] | None = None) -> Checkpoint:
        """This rank's part of a checkpoint weight: its output rows (column-parallel) or its
        input columns (row-parallel: whole quantization groups only)."""
        if self.parallel == "column" or part is not None:
            own, num_rows = part or (self.out_part, self.checkpoint_out_features)
            weight = _narrow_rows(weight, own, num_rows, name)
        if self.parallel == "row":
            if not isinstance(weight, QuantizedWeight) and hasattr(self.quant_method, "quantize"):
                # Quantized at load: the whole weight, as one rank would, then this rank's inputs
                # (int8's one scale per row stays the row's, not the half-row's).
                _check_columns(weight, self.checkpoint_in_features, name)
                weight = self.quant_method.quantize(weight)
            if isinstance(weight, QuantizedWeight):
                weight = weight.columns(self.in_part, name)
            else:
                _check_columns(weight, self.checkpoint_in_features, name)
                weight = weight[:, self.in_part]
        return weight

    def weight_param_names(self) -> tuple[str, ...]:
        return self.quant_method.weight_names()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, method={self.quant_method.name}"
        )


class Embedding(Linear):
    """Token embeddings in the same storage as a Linear (vocab_size, hidden_size), so that a
    quantized embedding is looked up by dequantizing only the rows asked for, and a tied
    model's logits run through the same method as any other linear layer (`linear`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: str | None = None):
        if parallel not in (None, "column"):
            raise ValueError("an embedding splits over its vocabulary (parallel='column') only")
        if parallel:
            tp_state.current().split(num_embeddings, "vocab_size")  # the error names it
        super().__init__(embedding_dim, num_embeddings, bias=False, parallel=parallel)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # looks rows up
        if self.parallel is None:
            return self.quant_method.embedding(self, ids)
        # This rank's rows of the vocabulary; the other ids look up zeros, and the all-reduce
        # adds each id's one non-zero row.
        local = ids - self.out_part.start
        outside = (local < 0) | (local >= self.out_features)
        rows = self.quant_method.embedding(self, local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))


def can_pack_weights(dtype: torch.dtype, device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and onednn_takes(dtype)


def pack_linear_weights(model: nn.Module, keep_plain: bool = False) -> int:
    """Store the weight of every `Linear` in oneDNN's blocked layout, once, after loading.

    A bf16 F.linear on CPU hands oneDNN a plain row-major weight, which it reorders into
    its own layout on every call; a packed weight skips that, with bit-identical results
    (a fifth faster at 64 rows, about even at 300). What inductor's CPU freezing does,
    without compiling. For one row torch's own gemv over the plain weight is faster still:
    `keep_plain` keeps both (twice the memory) for single-token steps.
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
    """One Linear whose output is the concatenation of named HF projections.

    Column-parallel (`parallel="column"`), each projection is split on its own: a rank
    holds its part of q, of k and of v (of gate and of up), concatenated. `shard_parts`
    names a projection's rows for this rank where an even split is not it (replicated
    KV heads); `shard_sizes` are the checkpoint's sizes.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool,
        parallel: str | None = None,
        shard_parts: dict[str, slice] | None = None,
    ):
        if parallel not in (None, "column"):
            raise ValueError("a merged projection splits along its output (parallel='column') only")
        tp = tp_state.current() if parallel else tp_state.SINGLE
        parts = dict(shard_parts or {})
        for name, size in shard_sizes.items():
            if name not in parts:
                parts[name] = (
                    tp.split(size, f"the output features of {name} ({size})") if tp.enabled else slice(0, size)
                )
        super().__init__(in_features, sum(_length(p) for p in parts.values()), bias=bias)
        self.tp, self.parallel = tp, parallel if tp.enabled else None
        self.shard_parts = parts  # rows of each checkpoint projection this rank holds
        self.checkpoint_shard_sizes = dict(shard_sizes)
        self.shard_sizes = {name: _length(parts[name]) for name in shard_sizes}
        self.shard_offsets, offset = {}, 0
        for name, size in self.shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def shard_rows(self, name: str) -> slice:
        """The rows of W (and of the bias) that hold projection `name`."""
        offset = self.shard_offsets[name]
        return slice(offset, offset + self.shard_sizes[name])

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.shard_sizes.values()), dim=-1)

    def load_shard(self, shard: str, weight: Checkpoint, name: str) -> None:
        """Checkpoint projection `shard` (its whole weight) into this rank's rows of it."""
        part = (self.shard_parts[shard], self.checkpoint_shard_sizes[shard])
        self.load_weight(weight, name, self.shard_rows(shard), part)

    def load_shard_bias(self, shard: str, bias: Checkpoint, name: str) -> None:
        part = (self.shard_parts[shard], self.checkpoint_shard_sizes[shard])
        self.load_bias(bias, name, self.shard_rows(shard), part)


def _length(part: slice) -> int:
    return part.stop - part.start


def _narrow_rows(weight: Checkpoint, part: slice, expected_rows: int, name: str) -> Checkpoint:
    if weight.shape[0] != expected_rows:
        expected = (expected_rows, *tuple(weight.shape)[1:])
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(weight.shape)} != model shape {expected}")
    return weight.rows(part) if isinstance(weight, QuantizedWeight) else weight[part]


def _check_columns(weight: torch.Tensor, expected: int, name: str) -> None:
    if weight.dim() != 2 or weight.shape[1] != expected:
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(weight.shape)}, expected {expected} columns")


def copy_weight(dst: torch.Tensor, src: Checkpoint, name: str) -> None:
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
        if kind == "bias" and prefix in linears and linears[prefix].parallel and name in params:
            linears[prefix].load_bias(tensor, name)  # this rank's part of it
            loaded.add(name)
            continue
        if name in params:
            copy_weight(params[name], tensor, name)
            loaded.add(name)
            continue
        shard = prefix.rpartition(".")[2]
        if (
            prefix not in merged
            or kind not in ("weight", "bias")
            or (kind == "bias" and merged[prefix][1].bias is None)
        ):
            raise ValueError(f"tensor {name!r} {tuple(tensor.shape)} does not belong to this model")
        path, module = merged[prefix]
        if kind == "weight":
            module.load_shard(shard, tensor, name)
        else:
            module.load_shard_bias(shard, tensor, name)
        seen = shards_seen.setdefault(f"{path}.{kind}", set())
        seen.add(shard)
        if len(seen) == len(module.shard_sizes):
            if kind == "weight":
                weight_loaded(path, module)
            else:
                loaded.add(f"{path}.bias")
    return loaded
