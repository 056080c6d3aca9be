"""CPU memory the kernels stream: one arena backed by 2 MiB pages where the kernel allows.

A decode reads every weight once a step (and every KV row of its sequences): a stream of tens
of MB to GBs. On 4 KiB pages that stream crosses a page every 4 KiB, and the hardware
prefetchers stop at each crossing (and the TLB's few thousand entries cover a few MB); and a
model loaded tensor by tensor lies scattered across the heap. Here a model's tensors are
copied, in the order the model holds them, into one anonymous mapping advised
MADV_HUGEPAGE (transparent huge pages in "madvise" mode, most distributions' default), and
the KV caches are allocated in another: a one-row step's products run ~10% faster
(docs/benchmarks.md); the same weights each in its own huge-page mapping gained about half of that.

Where the kernel refuses (THP "never", not Linux), the memory is an ordinary mapping: the same
numbers, contiguous, 4 KiB pages. `PAGEDSERVE_HUGEPAGES=0` keeps torch's own allocations.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line
_TRIM_EVERY = 256 << 20  # move_to_arena hands freed heap pages back to the OS after this many bytes


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_HUGEPAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


class Arena:
    """`nbytes` of zeroed memory, 2 MiB-aligned, advised for huge pages; `take(n)` hands out
    64-byte-aligned uint8 slices in order. Lives as long as any tensor made from it."""

    def __init__(self, nbytes: int):
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        start = (-whole.data_ptr()) % HUGE_PAGE
        self.memory = whole[start : start + nbytes]
        self.huge = True
        try:  # before the first touch, so the faults take whole huge pages
            self._map.madvise(mmap.MADV_HUGEPAGE, start, nbytes)  # `start` is a multiple of the page size
        except OSError:
            self.huge = False
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        begin = -(-self.used // ALIGN) * ALIGN
        if begin + nbytes > self.memory.numel():
            raise ValueError(f"arena of {self.memory.numel()} bytes cannot take {nbytes} more after {begin}")
        self.used = begin + nbytes
        return self.memory[begin : begin + nbytes]


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def move_to_arena(model: nn.Module) -> Arena | None:
    """Copy every CPU parameter and buffer of `model` (each storage once: tied weights stay
    tied) into one arena and point the tensors at it. Returns the arena, or None where nothing
    moved (disabled, another device, only oneDNN-packed weights)."""
    if not enabled():
        return None
    storages: dict[int, list[torch.Tensor]] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn or t.numel() == 0:
            continue
        storages.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    if not storages:
        return None
    arena = Arena(sum(_padded(ts[0].untyped_storage().nbytes()) for ts in storages.values()))
    moved = 0  # bytes copied since the heap was last trimmed
    with torch.no_grad():
        for tensors in storages.values():
            old = tensors[0].untyped_storage()
            region = arena.take(old.nbytes())
            region.copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            base = region.data_ptr() - arena.memory.untyped_storage().data_ptr()  # bytes into the mapping
            for t in {id(t): t for t in tensors}.values():
                t.set_(region.untyped_storage(), base // t.element_size() + t.storage_offset(), t.size(), t.stride())
            moved += old.nbytes()
            del old  # the last reference to the old copy: freed here
            if moved >= _TRIM_EVERY:
                # as we go, not once at the end: else the process holds the weights twice at its peak
                _release_freed_memory()
                moved = 0
    _release_freed_memory()
    logger.info(
        "weights: %.1f MiB in one arena (%s)",
        arena.used / 2**20,
        "huge pages advised" if arena.huge else "4 KiB pages: the kernel refused huge pages",
    )
    return arena


def _release_freed_memory() -> None:
    """Hand the heap's freed pages (the weights' old copies) back to the OS: glibc keeps them
    for later allocations otherwise, and the process would show the weights twice in its RSS."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed CPU tensors of these shapes, one after another in one arena (torch.zeros each
    where disabled)."""
    if not enabled():
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = [size * torch.Size(shape).numel() for shape in shapes]
    arena = Arena(sum(_padded(n) for n in nbytes))
    out = [arena.take(n).view(dtype).view(shape) for n, shape in zip(nbytes, shapes)]
    for t in out:
        t.zero_()  # fault the pages in now (anonymous memory is zero already), not in a step
    return out
