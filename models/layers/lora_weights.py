"""A step's rows by LoRA adapter and one Linear's adapters: what the Linear layers and the step's
kernels hold, apart from models/layers/lora.py (which reads adapters and imports the layers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from models.layers import cpu_kernels


@dataclass(frozen=True)
class LoRABatch:
    """One step's rows by adapter slot: (slot, rows), rows a slice where they are contiguous."""

    groups: tuple[tuple[int, slice | torch.Tensor], ...]

    @classmethod
    def build(cls, query_lens: list[int], slots: list[int], device: torch.device) -> LoRABatch | None:
        """Each request's `query_lens` rows take its slot (0: no adapter); None when no row has one."""
        rows: dict[int, list[int]] = {}
        start = 0
        for num, slot in zip(query_lens, slots, strict=True):
            if slot:
                rows.setdefault(slot, []).extend(range(start, start + num))
            start += num
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, found in rows.items():
            if found[-1] - found[0] + 1 == len(found):
                groups.append((slot, slice(found[0], found[-1] + 1)))
            else:
                groups.append((slot, torch.tensor(found, dtype=torch.int64, device=device)))
        return cls(tuple(groups)) if groups else None

    @classmethod
    def of_rows(cls, slots: torch.Tensor) -> LoRABatch | None:
        """Row i takes slots[i] (an int64 tensor; 0: no adapter): a MoE expert's pairs (models/layers/moe.py)."""
        values = slots.tolist()
        return cls.build([1] * len(values), values, slots.device)

    def row_slots(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """Each of the step's `num_rows` rows' slot (0: no adapter), int64."""
        slots = torch.zeros(num_rows, dtype=torch.int64, device=device)
        for slot, rows in self.groups:
            slots[rows] = slot
        return slots


class AdapterWeights(NamedTuple):
    """One adapter of one Linear: A_cat (R, in) and B_cat transposed, `bt` (R, out), zeros where a
    merged layer's projection is not adapted; `blocks` the parts of bt that are not, (o, n, c, r)
    each: outputs o .. o+n from ranks c .. c+r (csrc/lora_ops.cpp reads only those)."""

    a: torch.Tensor
    bt: torch.Tensor
    scale: float
    blocks: tuple[int, ...]


class LoRAWeights:
    """The adapters of one Linear, by slot."""

    def __init__(self, row_invariant: bool = False):
        self.slots: dict[int, AdapterWeights] = {}
        # The base layer computes each row alone (quantized kernels, --batch-invariant): so do the
        # adapter's products, on CPU (csrc/lora_ops.cpp); else torch's GEMMs, faster from tens of rows.
        self.row_invariant = row_invariant

    def apply(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch | None) -> torch.Tensor:
        """out (the base layer's x W^T + b) plus each row's adapter term, in place."""
        if batch is None:
            return out
        for slot, rows in batch.groups:
            found = self.slots.get(slot)
            if found is None:  # this adapter leaves the layer alone
                continue
            a, bt, scale, blocks = found
            if self.row_invariant and x.device.type == "cpu" and cpu_kernels.available():
                # Each row summed in an order of its own: an adapter's row is the same whatever the
                # step's size (speculative verification, batching), as the base layer's rows are.
                if out.dtype == torch.float32 and hasattr(torch.ops.pagedserve, "lora_add"):
                    if isinstance(rows, slice):  # views of the rows: no gather
                        torch.ops.pagedserve.lora_add(out[rows], x[rows], None, a, bt, blocks, scale)
                    else:
                        torch.ops.pagedserve.lora_add(out, x, rows, a, bt, blocks, scale)
                    continue
                hidden = cpu_kernels.rows_matmul(x[rows], a, kn=False)  # (num_rows, R) float32
                delta = cpu_kernels.rows_matmul(hidden, bt, kn=True) * scale  # PEFT's order: B(A x) * scale
            else:
                # 16-bit adapters (--lora-dtype) on float32 activations: computed in float32
                dtype = torch.promote_types(x.dtype, a.dtype)
                x_rows = x[rows].to(dtype)  # (num_rows, in)
                delta = ((x_rows @ a.t().to(dtype)) @ bt.to(dtype)) * scale  # (num_rows, out), PEFT's order
            if isinstance(rows, slice):
                out[rows] += delta.to(out.dtype)
            else:
                out.index_add_(0, rows, delta.to(out.dtype))
        return out
