"""Gated MLP (SwiGLU for silu): down(act(gate(x)) * up(x)), gate and up in one matmul.

Built under tensor parallelism (models/layers/parallel.py), gate/up are column-parallel
and down row-parallel: each rank holds intermediate_size / N of the MLP, and one
all-reduce (none with `reduce=False`: the caller adds several first) ends it."""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from models.layers import cpu_kernels
from models.layers import parallel as tp_state
from models.layers.linear import Linear, MergedLinear
from models.layers.step_kernels import StepKernels


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 reduce: bool = True):
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
        if self.is_silu and cpu_kernels.usable(x):
            layer = self.gate_up_proj  # column-parallel: this rank's [gate | up], no gather
            act = layer.quant_method.apply_silu_mul(layer, x, layer.bias, kernels)
            if act is None:
                act = cpu_kernels.silu_and_mul(self.gate_up_proj(x, kernels))
            return self.down_proj(act, kernels)
        gate_up = self.gate_up_proj(x, kernels)  # (num_tokens, 2 * intermediate_size)
        gate, up = self.gate_up_proj.split(gate_up)  # each (num_tokens, intermediate_size)
        return self.down_proj(self.act_fn(gate) * up, kernels)
