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
torch.distributed process group (gloo on CPU, NCCL on CUDA), or `ShmCommunicator` for CPU
ranks of one machine (a shared-memory buffer, far faster than gloo's TCP on loopback); the tests
run ranks as threads of one process with another. Every one of them adds the ranks'
tensors so that every rank gets the same bits; the shared-memory one adds them in rank order.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
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

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place."""
        raise NotImplementedError


class DistCommunicator(Communicator):
    """torch.distributed collectives over `group` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.root = dist.get_global_rank(group, 0) if group is not None else 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))] if self.rank == 0 else None
        dist.gather(x, parts, dst=self.root, group=self.group)
        return parts

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=self.root, group=self.group)
        return x


class ShmCommunicator(Communicator):
    """The ranks of one machine (CPU tensors) through one shared-memory file.

    Per rank, two slots of `capacity` float32 numbers (collectives alternate between them)
    and a sequence number. Collective number g: a rank waits until every rank has posted
    g - 1 (so everyone has finished reading the slot it is about to reuse, last used by
    g - 2), copies its tensor into its slot g % 2, and posts g; all-reduce then waits for
    every rank's g and adds the slots in rank order, so each rank computes the same sum.
    Larger tensors go through in pieces of `capacity`. Waiting spins (each rank has its own
    cores; it yields the CPU after a while) and gives up after `timeout` seconds or once
    `abort()` says a rank is gone. x86 only: its stores become visible in program order (the
    data before the sequence number), which this relies on.
    """

    FLAG_STRIDE = 8  # int64s per rank's sequence number: one 64-byte cache line each

    def __init__(self, rank: int, size: int, path: str, capacity: int, create: bool, timeout: float = 30.0):
        self.rank, self.size, self.capacity, self.timeout = rank, size, capacity, timeout
        flag_bytes = size * self.FLAG_STRIDE * 8
        nbytes = flag_bytes + 2 * size * capacity * 4
        if create:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        storage = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self._flags = storage[:flag_bytes].view(torch.int64).view(size, self.FLAG_STRIDE)
        self._seen = self._flags.numpy()[:, 0]  # read without torch's per-op overhead
        self._slots = storage[flag_bytes:].view(torch.float32).view(2, size, capacity)
        self._generation = 0
        self.aborted: str | None = None

    @staticmethod
    def supported() -> bool:
        import platform

        return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")

    def abort(self, reason: str) -> None:
        """Make every wait (now or later) raise: a rank is gone."""
        self.aborted = reason

    def _wait_all(self, generation: int) -> None:
        # Spin ~0.1-0.2 ms (ranks on cores of their own answer within it), then give the CPU
        # away: yield, and after ~2000 tries sleep 50 us a time (ranks sharing cores).
        spins, deadline = 0, None
        while self._seen.min() < generation:
            spins += 1
            if spins < 128:
                continue
            if self.aborted:
                raise RuntimeError(f"shared-memory collective aborted: {self.aborted}")
            if deadline is None:
                deadline = time.monotonic() + self.timeout
            elif time.monotonic() > deadline:
                raise RuntimeError(f"shared-memory collective: no answer from every rank in {self.timeout:g} s")
            if spins < 2048:
                os.sched_yield()
            else:
                time.sleep(50e-6)

    def _post(self, flat: torch.Tensor) -> torch.Tensor:
        """Steps one to three of a collective over `flat` (at most `capacity` numbers): this rank's slot."""
        self._generation += 1
        g = self._generation
        self._wait_all(g - 1)
        slots = self._slots[g % 2, :, : flat.numel()]
        slots[self.rank].copy_(flat)
        self._seen[self.rank] = g
        return slots

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Added in float32 (bf16/fp16 values widen exactly), in rank order, rounded back to x's dtype."""
        if not x.is_floating_point():
            raise ValueError(f"the shared-memory all-reduce adds floating-point tensors, got {x.dtype}")
        flat = x.reshape(-1)  # a view where x is contiguous; else a copy, written back below
        for start in range(0, flat.numel(), self.capacity):
            piece = flat[start : start + self.capacity]
            slots = self._post(piece)
            self._wait_all(self._generation)
            if piece.dtype == torch.float32:
                torch.add(slots[0], slots[1], out=piece)
                for r in range(2, self.size):
                    piece += slots[r]
            else:
                total = slots[0] + slots[1]
                for r in range(2, self.size):
                    total += slots[r]
                piece.copy_(total)
        if flat.data_ptr() != x.data_ptr() or not x.is_contiguous():
            x.copy_(flat.view_as(x))
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Through float32 slots: exact for float32, bf16 and fp16 values."""
        x = x.contiguous()
        if not x.is_floating_point():
            raise ValueError(f"the shared-memory gather takes floating-point tensors, got {x.dtype}")
        flat, parts = x.view(-1), [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        for start in range(0, flat.numel(), self.capacity):
            piece = flat[start : start + self.capacity]
            slots = self._post(piece)
            if parts is not None:  # rank 0
                self._wait_all(self._generation)
                for r in range(self.size):
                    parts[r].view(-1)[start : start + piece.numel()].copy_(slots[r])
        return parts


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    comm: Communicator | None = None  # None: size 1

    def __post_init__(self) -> None:
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
        return self.comm.all_reduce(x) if self.size > 1 and self.comm is not None else x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `x` concatenated along the last dim, in rank order; other
        ranks get their own `x` back (only rank 0 samples)."""
        if self.size == 1 or self.comm is None:
            return x
        parts = self.comm.gather(x.contiguous())  # None on every rank but 0
        return torch.cat(parts, dim=-1) if parts is not None else x


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
        raise ValueError(
            f"tensor parallel size {tp.size} is neither a divisor nor a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head = tp.rank // (tp.size // num_kv_heads)
    return slice(head, head + 1)
