"""Tensor parallelism: which part of each layer a rank holds, and the collectives between ranks.

Layers are split as vLLM, SGLang and nano-vllm split them (Megatron's scheme), with N ranks:

    column-parallel  W (out, in) -> rows [r*out/N, (r+1)*out/N)    q/k/v, gate/up, q_b, lm_head
                     (each rank computes its slice of the output; nothing to combine)
    row-parallel     W (out, in) -> cols [r*in/N, (r+1)*in/N)      o_proj, down_proj
                     (each rank a partial sum over its inputs; one all-reduce adds them;
                      the bias is added once, by rank 0, before it)
    vocab-parallel   embedding rows [r*V/N, ...): a rank looks up the ids it holds, zeros
                     for the rest, and an all-reduce adds them (exact: one non-zero term);
                     logits: each rank's slice of the vocab, gathered on rank 0
    replicated       everything else (norms, MLA's latent projections, the MoE router)

A model is built under `building(tp)` and its parallel layers keep that `TensorParallel`;
every collective goes through its `Communicator`: `DistCommunicator` over a
torch.distributed process group (gloo on CPU, NCCL on CUDA), the one place a faster
shared-memory all-reduce would replace it; the tests run ranks as threads of one process
with another.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist


class Communicator:
    """The collectives tensor parallelism needs, between the N ranks of one model."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place: every rank gets the same bits."""
        raise NotImplementedError

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's `x`, in rank order; other ranks: None."""
        raise NotImplementedError


class DistCommunicator(Communicator):
    """torch.distributed collectives over `group` (None: the default group)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.root = dist.get_global_rank(group, 0) if group is not None else 0

    def all_reduce(self, x):
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))] if self.rank == 0 else None
        dist.gather(x, parts, dst=self.root, group=self.group)
        return parts


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    comm: Communicator | None = None  # None: size 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} of size {self.size}")
        if self.size > 1 and self.comm is None:
            raise ValueError("tensor parallel size > 1 needs a communicator")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def split(self, total: int, what: str) -> slice:
        """This rank's part of `total` (rows, heads, vocab entries): N must divide it."""
        if total % self.size:
            raise ValueError(f"tensor parallel size {self.size} does not divide {what} ({total})")
        part = total // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (every rank gets the same bits)."""
        return self.comm.all_reduce(x) if self.size > 1 else x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `x` concatenated along the last dim, in rank order; other
        ranks get their own `x` back (only rank 0 samples)."""
        if self.size == 1:
            return x
        parts = self.comm.gather(x.contiguous())
        return torch.cat(parts, dim=-1) if self.rank == 0 else x


SINGLE = TensorParallel()
_building: contextvars.ContextVar[TensorParallel] = contextvars.ContextVar("tensor_parallel", default=SINGLE)


def current() -> TensorParallel:
    """The split that layers built now take (SINGLE outside `building`)."""
    return _building.get()


@contextlib.contextmanager
def building(tp: TensorParallel | None) -> Iterator[TensorParallel]:
    """Build a model's layers as rank `tp.rank` of `tp.size` (in this thread or task only)."""
    token = _building.set(tp or SINGLE)
    try:
        yield _building.get()
    finally:
        _building.reset(token)


def kv_head_slice(num_kv_heads: int, tp: TensorParallel) -> slice:
    """The KV heads a rank holds: an equal share when N divides them; when N exceeds them
    (N a multiple), each head replicated on N / num_kv_heads consecutive ranks, as vLLM does."""
    if tp.size <= num_kv_heads:
        return tp.split(num_kv_heads, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor parallel size {tp.size} is neither a divisor nor a multiple of "
                         f"num_key_value_heads ({num_kv_heads})")
    head = tp.rank // (tp.size // num_kv_heads)
    return slice(head, head + 1)
