"""Which kernels one step's matmuls run on: a value chosen for each step (by the runner,
engine/threads.py) that the layers receive with the step, as `AttentionMetadata.kernels`.

    onednn   True: torch's default, bf16/fp16 matmuls go to oneDNN where the CPU supports
             it (and a Linear uses its oneDNN-packed weight). False: torch's own kernels
             (a Linear with a plain weight kept beside the packed one uses that for a
             single row: torch's gemv reads it faster).
    lora     which LoRA adapter each row of the step adds (models/layers/lora.py LoRABatch);
             None: no row uses one, and no layer adds anything.

The layers read the choice from the step, never from torch.backends.mkldnn.enabled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from models.layers.lora_weights import LoRABatch


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether torch sends CPU matmuls of `dtype` to oneDNN on this machine: where it does
    not, switching oneDNN off changes no kernel."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False  # float32 goes to oneDNN only in torch's opt-in reduced-precision modes


@dataclass(frozen=True)
class StepKernels:
    onednn: bool = True  # False: torch's own kernels for reduced-precision matmuls
    lora: LoRABatch | None = field(default=None, compare=False)

    def matmul(self, op: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        """op(*args), a matmul (F.linear, torch.bmm, torch.einsum), on the kernels this step chose.

        torch has no per-call way to its own reduced-precision kernels while oneDNN is
        enabled: its one switch is process-wide. So the switch is turned off for this call
        alone and put back, through the accessors torch.backends.mkldnn.enabled calls
        (without its Python-level checks: this runs for every linear of a single-token step).
        """
        if self.onednn:
            return op(*args)
        enabled = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return op(*args)
        finally:
            torch._C._set_mkldnn_enabled(enabled)


DEFAULT_KERNELS = StepKernels()
