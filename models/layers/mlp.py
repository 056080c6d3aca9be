"""Gated MLP (SwiGLU for silu): down(act(gate(x)) * up(x)), gate and up in one matmul.

Built under tensor parallelism (models/layers/parallel.py), gate/up are column-parallel
and down row-parallel: each rank holds intermediate_size / N of the MLP, and one
all-reduce (none with `reduce=False`: the caller adds several first) ends it."""

from __future__ import annotations

import torch
from collections.abc import Callable

from torch import nn
from transformers.activations import ACT2FN

from models.layers import cpu_kernels
from models.layers import parallel as tp_state
from models.layers.linear import Linear, MergedLinear
from models.layers.step_kernels import StepKernels


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        bias: bool = False,
        reduce: bool = True,
    ):
        super().__init__()
        if hidden_act not in ACT2FN:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}")
        tp_state.current().split(intermediate_size, "intermediate_size")  # the error names it
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=bias, parallel="column"
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, parallel="row", reduce=reduce)
        self.act_fn = ACT2FN[hidden_act]
        self.is_silu = hidden_act == "silu"

    def forward(self, x: torch.Tensor, kernels: StepKernels) -> torch.Tensor:
        return gated(self.gate_up_proj, self.down_proj, self.act_fn, self.is_silu, x, kernels)


def gated(
    gate_up_proj: MergedLinear,
    down_proj: Linear,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    is_silu: bool,
    x: torch.Tensor,
    kernels: StepKernels,
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)): GatedMLP's forward, and each routed expert's (models/layers/moe.py).
    On CPU, silu's on our kernels (each element the same bits wherever it falls in the step)."""
    if is_silu and cpu_kernels.usable(x):
        act = None
        if gate_up_proj.lora is None or kernels.lora is None:  # the fused op adds no adapter
            act = gate_up_proj.quant_method.apply_silu_mul(gate_up_proj, x, gate_up_proj.bias, kernels)
        if act is None:
            act = cpu_kernels.silu_and_mul(gate_up_proj(x, kernels))  # column-parallel: this rank's [gate | up]
        return down_proj(act, kernels)
    gate, up = gate_up_proj.split(gate_up_proj(x, kernels))  # each (num_tokens, intermediate_size)
    return down_proj(act_fn(gate) * up, kernels)
