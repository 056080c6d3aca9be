"""RMSNorm computed in float32 and cast back, exactly as transformers' Llama/Qwen do; and Gemma's,
which scales by (1 + weight) in float32 before the cast."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and cpu_kernels.usable(x):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)  # one pass, same rounding as below
        # Same rounding as the reference (normalize in float32, cast, then scale) so
        # bfloat16 matches bit for bit, not just float32: F.rms_norm without a weight
        # normalizes in float32 and rounds once; the weight is applied after, in x's dtype.
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32, then cast to x's dtype (Llama
    casts before scaling). The weight stays as checkpoints store it (zero-centred), so that its
    tensor loads as it is and 1 + w rounds as transformers rounds it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        # transformers' own ops, so that float32 matches bit for bit.
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
