"""Weights and KV caches in one huge-page arena (models/layers/hugepages.py): the same numbers,
the same ties, the same model output, each tensor inside the mapping."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from models.layers import hugepages
from models.layers.attention import KVCacheSpec


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 24)
        self.proj = nn.Linear(24, 40)
        self.head = nn.Linear(24, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 24))
        self.f16 = nn.Parameter(torch.randn(7, dtype=torch.float16), requires_grad=False)

    def forward(self, ids):
        h = self.embed(ids) * self.scale
        return self.head(h) + self.proj(h).sum(-1, keepdim=True) + self.f16.float().sum()


def inside(t: torch.Tensor, arena: hugepages.Arena) -> bool:
    begin = arena.memory.data_ptr()
    return begin <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= begin + arena.used


def test_a_moved_model_gives_the_same_output_and_keeps_its_ties():
    torch.manual_seed(0)
    model = Tied().eval()
    ids = torch.randint(0, 50, (3, 5))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    expected = model(ids)
    arena = hugepages.move_to_arena(model)
    assert arena is not None
    gc.collect()  # the old storages are gone; the arena's tensors hold the mapping
    for name, t in model.state_dict().items():
        assert inside(t, arena), name
        assert torch.equal(t, before[name]), name
        assert t.data_ptr() % hugepages.ALIGN == 0
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert torch.equal(model(ids), expected)
    with torch.no_grad():  # still writable, and a tie still one tensor
        model.embed.weight[0, 0] = 123.0
    assert model.head.weight[0, 0] == 123.0


def test_kv_caches_are_zeroed_views_of_one_arena_and_can_be_switched_off(monkeypatch):
    spec = KVCacheSpec(3, (2, 2, 8), torch.float16)
    caches = spec.allocate(5, 4, "cpu")
    assert [c.shape for c in caches] == [torch.Size((5, 4, 2, 2, 8))] * 3
    assert all(c.dtype == torch.float16 and c.is_contiguous() and not c.any() for c in caches)
    storages = {c.untyped_storage().data_ptr() for c in caches}
    assert len(storages) == 1  # one mapping
    caches[1].fill_(1.0)
    assert not caches[0].any() and not caches[2].any()  # no overlap
    monkeypatch.setenv("PAGEDSERVE_HUGEPAGES", "0")
    assert not hugepages.enabled()
    plain = spec.allocate(5, 4, "cpu")
    assert len({c.untyped_storage().data_ptr() for c in plain}) == 3
    assert hugepages.move_to_arena(Tied()) is None


def test_an_arena_refuses_what_it_cannot_hold():
    arena = hugepages.Arena(1000)
    assert arena.take(10).numel() == 10
    assert arena.take(900).data_ptr() - arena.memory.data_ptr() == 64  # 64-byte aligned
    with pytest.raises(ValueError, match="cannot take"):
        arena.take(100)


@pytest.mark.skipif(not hugepages.enabled(), reason="no MADV_HUGEPAGE here")
def test_huge_pages_back_the_arena_where_the_kernel_allows_them():
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    arena = hugepages.Arena(8 << 20)
    assert arena.huge
    assert arena.memory.data_ptr() % hugepages.HUGE_PAGE == 0
    arena.memory.fill_(1)
    start, end = arena.memory.data_ptr(), arena.memory.data_ptr() + arena.memory.numel()
    huge_kb = 0
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    region = None
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            region = lo <= start and end <= hi
        elif region and line.startswith("AnonHugePages:"):
            huge_kb = int(line.split()[1])
    if huge_kb == 0:
        pytest.skip("the kernel gave 4 KiB pages (no free huge pages now): the arena works either way")
    assert huge_kb >= 2048
