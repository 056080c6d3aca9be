"""Paged attention, our C++ kernel on CPU and plain PyTorch elsewhere: the runner builds
`AttentionMetadata` once per step, every layer reuses it (and reads the step's choice of kernels
from it).

The KV cache of one layer is a tensor of shape (num_blocks, block_size, *entry_shape);
flattened, slot `s = block_id * block_size + offset` holds one token's entry.

    block_table of a sequence:  [7, 2, 9]          block_size = 4
    its token t lives at slot:  block_table[t // 4] * 4 + t % 4
    token 5 -> block 2, offset 1 -> slot 9

`write_kv` / `gather_kv` store entries in that token-major order (MLA's latent cache).
`paged_attention` (GQA) keeps the allocation shape but lays the memory out block-major:
a block holds its tokens' keys, then their values, a KV head at a time:

    kv_cache.view(num_blocks, 2, num_kv_heads, block_size, head_dim)   see `kv_blocks`

so that one block is one run of memory (20 KiB for SmolLM2-360M's 5 KV heads x 16 tokens in
16 bits), read front to back as the kernel attends a sequence head by head: a decode reads a
sequence's cache as a few long runs instead of 2 KiB pieces scattered over the pool (a KV head's
plane, the layout before this one). Gathering blocks for the eager paths is one `index_select`
over a permuted view, straight into (k or v, kv head, sequence, position, head_dim), in a buffer
that every layer of the step reuses (`AttentionGroup.buffer`). Block ids mean the same in every
layout, which is all the block manager sees.

On CPU with our kernels built (cpu_kernels.py), every query row of the step goes through one
C++ kernel (csrc/paged_attention.cpp): a query at position p attends keys 0..p read from the
cache (this step's keys and values are written there first), each row computed alone in an order
fixed by p. So a token's output is the same bits whether it is a decode, a row of a fresh prompt
or of a chunk after cached (or prefix-cache-hit) tokens, whatever its neighbours in the step and
the thread count; a 16-bit cache is read by prompts as well as decodes.

Elsewhere (other devices, no compiler) the eager paths serve, and are the reference the kernel is
tested against. Sequences with one query token (decodes), fresh prefills and prefill chunks after
cached tokens go into separate `AttentionGroup`s, so that a long prompt does not pad every decode
up to its length and one chunk does not make every prompt gather. Each group is attended with one
batched call; cached keys are gathered a block at a time (num_blocks * block_size keys per sequence):

    decodes          two bmm's and a softmax over the gathered blocks (SDPA's CPU kernel is
                     ~10x slower for a single query row)
    fresh prefills   nothing cached yet: the keys are this step's own k/v, so no
                     gather and no mask, just causal SDPA
    other prefills   gathered context + boolean mask (chunks after cached tokens)

These are not row-invariant: which path a token takes, and its padded batch, change its rounding.

A layer may attend within a sliding window (`window`: a query at position p sees keys at positions
> p - window, transformers' `sliding_window` in masking_utils) and soft-cap its scores (`softcap`:
softcap * tanh(score / softcap) before the softmax, Gemma 2). The kernel takes both; the eager
paths mask the window (a mask per window, kept on the group) and, to soft-cap, attend with explicit
matmuls instead of SDPA, which has no soft-capping.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from models.layers import cpu_kernels, hugepages
from models.layers.step_kernels import DEFAULT_KERNELS, StepKernels


@dataclass(frozen=True)
class KVCacheLayout:
    """Which cache tensor and which KV cache group (block tables, engine/block_manager.py) each
    layer uses. Layers that attend alike form groups of `num_slots` layers (vLLM's hybrid KV cache
    manager); layer j of every group uses tensor j, so one block id is the same bytes in every group
    and a group's blocks come from the one pool. Gemma 3 1B (22 sliding layers, 4 global): 4
    tensors, 1 global group and 6 sliding ones (two slots of the last unused). A model whose layers
    all attend alike is one group, a tensor a layer."""

    windows: tuple[int | None, ...]  # per group: None (the whole context) or its sliding window
    layer_groups: tuple[int, ...]  # per layer
    layer_slots: tuple[int, ...]  # per layer: its tensor
    num_slots: int

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...]) -> "KVCacheLayout":
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        num_slots = min(len(layers) for layers in kinds.values())
        windows: list[int | None] = []
        groups, slots = [0] * len(layer_windows), [0] * len(layer_windows)
        for window, layers in kinds.items():
            for k, layer in enumerate(layers):
                groups[layer], slots[layer] = len(windows) + k // num_slots, k % num_slots
            windows += [window] * -(-len(layers) // num_slots)
        return cls(tuple(windows), tuple(groups), tuple(slots), num_slots)


@dataclass(frozen=True)
class KVCacheSpec:
    """What a model stores per token per layer; the block manager only sees blocks."""

    num_layers: int
    entry_shape: tuple[int, ...]  # GQA: (2, num_kv_heads, head_dim); MLA: (kv_lora_rank + qk_rope_head_dim,)
    dtype: torch.dtype  # torch.int8: quantized rows, see `stored_shape`
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full); empty: all full

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token in every layer."""
        return self.num_layers * self.bytes_per_entry

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """entry_shape as the cache tensor holds it: an int8 cache's rows carry their scale (quantize_rows)."""
        if self.dtype == torch.int8:
            return (*self.entry_shape[:-1], self.entry_shape[-1] + KV_SCALE_BYTES)
        return self.entry_shape

    @property
    def bytes_per_entry(self) -> int:
        numel = 1
        for dim in self.stored_shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()

    def layout(self, max_model_len: int) -> KVCacheLayout:
        """The layers grouped by window; a window that covers max_model_len is no window."""
        windows = self.layer_windows or (None,) * self.num_layers
        return KVCacheLayout.of(tuple(w if w is not None and w < max_model_len else None for w in windows))

    def allocate(
        self, num_blocks: int, block_size: int, device: torch.device | str, layout: KVCacheLayout | None = None
    ) -> list[torch.Tensor]:
        """One cache tensor per layer (layers of different groups share theirs under a layout;
        without one every layer has its own, and uses one block table)."""
        shape = (num_blocks, block_size, *self.stored_shape)
        num_tensors = self.num_layers if layout is None else layout.num_slots
        if torch.device(device).type == "cpu":  # one huge-page arena: decodes stream their rows
            tensors = hugepages.zeros([shape] * num_tensors, self.dtype)
        else:
            tensors = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_tensors)]
        return tensors if layout is None else [tensors[slot] for slot in layout.layer_slots]


@dataclass
class AttentionGroup:
    """Sequences attended together in one padded batched call.

    Keys are gathered block by block, so max_kv_len = num_blocks * block_size
    (at least the longest sequence); `mask` hides the padding.
    """

    token_index: torch.Tensor  # (num_group_tokens,) rows of the flat token batch in this group
    padded_index: torch.Tensor  # (num_group_tokens,) where each row goes in (num_seqs * max_query_len)
    num_seqs: int
    max_query_len: int
    block_table: torch.Tensor  # (num_seqs, num_blocks) int64 cache blocks of each sequence, padding -> block 0
    mask: torch.Tensor  # (num_seqs, 1, max_query_len, max_kv_len) True = may attend
    # Decodes only: the mask as an additive float32 bias (0 / -inf), (num_seqs, 1, max_kv_len).
    bias: torch.Tensor | None
    # (start, stop) when the group's padded layout is the slice [start, stop) of the flat
    # batch (its tokens are consecutive and need no padding): pad/unpad are views, no copies.
    token_range: tuple[int, int] | None
    # Every sequence starts at position 0 this step: its keys are exactly this step's k/v.
    is_fresh: bool
    seq_lens: torch.Tensor  # (num_seqs,) int64 tokens of each sequence, this step's included
    query_pos: torch.Tensor  # (num_seqs, max_query_len) int64 position of each padded query
    # `mask` and `bias` narrowed to a sliding window, one pair a window size (see `windowed`).
    window_masks: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict, repr=False)
    # The eager gathers' outputs, one buffer a (shape, dtype), reused by every layer of the step
    # (see `buffer`).
    workspace: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def windowed(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mask, bias) of the group for a layer whose queries see only keys at positions > p - window."""
        if window is None:
            return self.mask, self.bias
        if window not in self.window_masks:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            inside = keys[None, None, :] > self.query_pos[:, :, None] - window  # (n, max_q, max_kv)
            mask = self.mask & inside[:, None]
            # A padding query row may be left with no key (softmax NaN); its output is dropped.
            mask[..., 0] |= ~mask.any(dim=-1)
            bias = None
            if self.bias is not None:
                bias = torch.zeros(mask[:, 0].shape, dtype=torch.float32, device=mask.device)
                bias.masked_fill_(~mask[:, 0], float("-inf"))  # (n, 1, max_kv)
            self.window_masks[window] = (mask, bias)
        return self.window_masks[window]

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of this shape that the step's layers share: a layer's gathered keys are read
        before the next layer gathers. A fresh tensor of a gather's size (tens of MB) is mapped
        afresh by malloc and page-faulted in at every layer, at several times the gather's own cost
        (docs/benchmarks.md)."""
        key = (tuple(shape), dtype, device)
        buf = self.workspace.get(key)
        if buf is None:
            buf = self.workspace[key] = torch.empty(shape, dtype=dtype, device=device)
        return buf


@dataclass
class AttentionMetadata:
    """Everything the layers need for one step: where attention reads and writes, and
    which kernels the matmuls run on. Built by the runner, read by every layer."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64 cache slot that each new token's K/V is written to
    num_tokens: int
    block_table: torch.Tensor  # (num_seqs, max blocks used) int64 cache blocks of each sequence, padding -> block 0
    seq_lens: torch.Tensor  # (num_seqs,) int64 tokens of each sequence, this step's included
    query_start: torch.Tensor  # (num_seqs + 1,) int64: sequence i's tokens are rows query_start[i]..[i+1]-1
    kernels: StepKernels = DEFAULT_KERNELS
    # What `groups` is built from, on first use (the C++ kernel needs no groups: a CPU step never
    # builds them): query lens, seq lens (lists), the padded tables, block_size, device.
    group_inputs: tuple = field(default=(), repr=False)
    # Several KV cache groups (KVCacheLayout): each layer's metadata, its group's block tables.
    by_layer: list["AttentionMetadata"] | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        kernels: StepKernels = DEFAULT_KERNELS,
    ) -> "AttentionMetadata":
        """query_lens[i] new tokens of sequence i sit at the end of its seq_lens[i] tokens.

        Tokens are laid out flat, sequence after sequence, in the order given.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        # Plain Python over sequences and blocks, then one tensor each: a step of a few decodes
        # would otherwise spend longer in a dozen torch ops' dispatch than in the loops.
        used = [(s + block_size - 1) // block_size for s in seq_lens]
        width = max(used, default=0)
        rows: list[list[int]] = []
        slots: list[int] = []
        query_start = [0]
        for table, q, s, n in zip(block_tables, query_lens, seq_lens, used):
            if len(table) < n:
                raise ValueError(f"block table of {len(table)} blocks is too short for {n * block_size} tokens")
            row = table[:n]
            rows.append(row + [0] * (width - n) if n < width else row)
            # The new tokens sit at positions s - q .. s - 1: each block's share is one run of slots.
            position = s - q
            while position < s:
                offset = position % block_size
                run = min(block_size - offset, s - position)
                base = row[position // block_size] * block_size + offset
                slots.extend(range(base, base + run))
                position += run
            query_start.append(query_start[-1] + q)
        tables = torch.tensor(rows, dtype=torch.int64).view(len(rows), width)  # (num_seqs, width)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_tokens=query_start[-1],
            block_table=tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            query_start=torch.tensor(query_start, dtype=torch.int64, device=device),
            kernels=kernels,
            group_inputs=(list(query_lens), list(seq_lens), tables, block_size, device),
        )

    @functools.cached_property
    def groups(self) -> list[AttentionGroup]:
        """The eager paths' groups: decodes, fresh prefills (nothing cached: no gather) and
        prefill chunks after cached tokens attend differently; one chunk of a long prompt must
        not slow down the rest."""
        query_lens, seq_lens, tables, block_size, device = self.group_inputs
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        s_lens = torch.tensor(seq_lens, dtype=torch.int64)
        seq = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)  # (num_tokens,) sequence of each token
        query_no = torch.arange(self.num_tokens) - (torch.cumsum(q_lens, 0) - q_lens)[seq]
        is_decode = q_lens == 1
        is_fresh = ~is_decode & (q_lens == s_lens)
        kinds = [k for k in (is_decode, is_fresh, ~is_decode & ~is_fresh) if bool(k.any())]
        return [
            _build_group(k.nonzero().squeeze(1), k[seq], seq, query_no, q_lens, s_lens, tables, block_size, device)
            for k in kinds
        ]


def _build_group(
    idx: torch.Tensor,
    token_in_group: torch.Tensor,
    seq: torch.Tensor,
    query_no: torch.Tensor,
    q_lens: torch.Tensor,
    s_lens: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    device: torch.device | str,
) -> AttentionGroup:
    """idx: (n,) sequences of the group; token_in_group: (num_tokens,) bool."""
    n = idx.numel()
    q_lens, s_lens = q_lens[idx], s_lens[idx]
    max_q = int(q_lens.max())
    num_blocks = int(((s_lens + block_size - 1) // block_size).max())
    table = tables[idx, :num_blocks]  # (n, num_blocks)
    token_index = token_in_group.nonzero().squeeze(1)
    # Row of each sequence inside the group: position of its index in idx.
    row_of_seq = torch.zeros(tables.shape[0], dtype=torch.int64)
    row_of_seq[idx] = torch.arange(n)
    padded_index = row_of_seq[seq[token_index]] * max_q + query_no[token_index]
    pos = torch.arange(num_blocks * block_size)
    # Query j of a sequence sits at absolute position seq_len - q_len + j; it sees keys at <= that.
    q_pos = (s_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]  # (n, max_q)
    mask = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < s_lens[:, None, None])
    # Padding query rows must see at least one key or softmax yields NaN; their output is dropped.
    mask[:, :, 0] = True
    start, stop = int(token_index[0]), int(token_index[-1]) + 1
    token_range = (start, stop) if stop - start == token_index.numel() == n * max_q else None
    bias = None
    if max_q == 1:
        bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
    return AttentionGroup(
        token_index=token_index.to(device),
        padded_index=padded_index.to(device),
        num_seqs=n,
        max_query_len=max_q,
        block_table=table.to(device),
        mask=mask[:, None].to(device),  # (n, 1, max_q, max_kv)
        bias=None if bias is None else bias.to(device),  # (n, 1, max_kv)
        token_range=token_range,
        is_fresh=bool((q_lens == s_lens).all()),
        seq_lens=s_lens.to(device),
        query_pos=q_pos.to(device),
    )


# An int8 cache (--kv-cache-dtype int8) stores each row (a token's key or value of one KV head, or
# an MLA latent) as D int8 numbers round(x / scale) followed by the 2 bytes of its float16 scale
# absmax / 127: symmetric, one scale per token per KV head, so a row's error is at most half a step
# of its own scale whatever else is in its block. The scale is rounded to float16 first and the row
# quantized against the rounded scale, so the scale read back is the one the numbers were made with.
# The scale sits in the row itself rather than in a parallel tensor: a layer's cache stays one tensor
# (every model, the block-major layout, the huge-page arena and the fused decoder layer keep their
# signatures), and the kernel finds a row's scale where it reads the row. A row of 64 numbers is 66
# bytes: 3.88x fewer than float32's 256, 1.94x fewer than bfloat16's 128 (a float32 scale made it
# 68 bytes, 1.88x).
#
# Keys may be stored less a per-channel offset and divided by a per-channel scale of their layer and
# KV head, the queries multiplied by it (LlamaAttention.int8_keys, calibrated by models/kv_int8.py):
# the scores are the same but for a shift the softmax takes out, while the rows' levels go to what
# varies from token to token rather than to one wide channel.
KV_SCALE_BYTES = 2
_FLOAT16_MAX = 65504.0


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) floating -> (..., D + 2) int8 rows with their scales (see KV_SCALE_BYTES); the same
    arithmetic as csrc/decode_ops.cpp's write_kv_blocks, so both write the same bytes."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # Divisions of whole tensors: `x / 127.0` is x * (1 / 127), another rounding.
    scale = (amax / torch.full_like(amax, 127.0)).clamp_(max=_FLOAT16_MAX).half()
    wide = scale.float()
    inv = torch.where(wide > 0, torch.full_like(wide, 1.0) / wide, torch.zeros_like(wide))
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., D + 2) int8 rows of quantize_rows -> (..., D) in `dtype` (computed in float32)."""
    width = rows.shape[-1] - KV_SCALE_BYTES
    scale = rows[..., width:].contiguous().view(torch.float16).float()  # (..., 1)
    return (rows[..., :width].to(torch.float32) * scale).to(dtype)


def write_kv(kv_cache: torch.Tensor, entries: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's cache entry (num_tokens, *entry_shape) at its slot (quantized in an int8 cache)."""
    flat = kv_cache.view(-1, *kv_cache.shape[2:])  # (num_slots, *stored entry shape)
    rows = quantize_rows(entries) if kv_cache.dtype == torch.int8 else entries.to(kv_cache.dtype)
    flat.index_copy_(0, slot_mapping, rows)


def gather_kv(kv_cache: torch.Tensor, group: AttentionGroup, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(num_seqs, max_kv_len, *entry_shape) entries of the group's sequences, in position order,
    in `dtype` (default the cache's; an int8 cache's are dequantized, by default to float32), into
    the group's buffers."""
    index = group.block_table.view(-1)
    blocks = group.buffer((index.numel(), *kv_cache.shape[1:]), kv_cache.dtype, kv_cache.device)
    torch.index_select(kv_cache, 0, index, out=blocks)  # (n * num_blocks, block_size, *entry_shape)
    if kv_cache.dtype == torch.int8:
        entries = dequantize_rows(blocks, dtype or torch.float32)
        return entries.view(group.num_seqs, -1, *entries.shape[2:])
    return _as_dtype(blocks, group, dtype).view(group.num_seqs, -1, *kv_cache.shape[2:])


def _as_dtype(x: torch.Tensor, group: AttentionGroup, dtype: torch.dtype | None) -> torch.Tensor:
    """x converted into a buffer of the group's (x itself when it has that dtype)."""
    if dtype is None or dtype == x.dtype:
        return x
    return group.buffer(x.shape, dtype, x.device).copy_(x)


def pad_queries(x: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """Rows of the flat batch (num_tokens, ...) -> (num_seqs, max_query_len, ...) for this group."""
    if group.token_range is not None:
        return x[slice(*group.token_range)].view(group.num_seqs, group.max_query_len, *x.shape[1:])
    padded = x.new_zeros((group.num_seqs * group.max_query_len, *x.shape[1:]))
    padded[group.padded_index] = x[group.token_index]
    return padded.view(group.num_seqs, group.max_query_len, *x.shape[1:])


def unpad_into(out: torch.Tensor, padded: torch.Tensor, group: AttentionGroup) -> None:
    """Inverse of pad_queries: scatter the group's real rows back into the flat output."""
    flat = padded.reshape(group.num_seqs * group.max_query_len, *padded.shape[2:])
    if group.token_range is not None:
        out[slice(*group.token_range)] = flat
    else:
        out[group.token_index] = flat[group.padded_index]


def kv_blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """The block-major view of a GQA cache (num_blocks, block_size, 2, Hk, D): (num_blocks, 2, Hk, block_size, D)
    (an int8 cache's D is its rows' stored width, scale included)."""
    num_blocks, block_size, _, num_kv_heads, head_dim = kv_cache.shape
    return kv_cache.view(num_blocks, 2, num_kv_heads, block_size, head_dim)


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v (num_tokens, Hk, D) into a GQA cache at their slots (block slot // block_size, offset
    slot % block_size), in PyTorch: what cpu_kernels.write_kv_blocks does in one pass. An int8
    cache gets each row quantized (quantize_rows)."""
    block_size = kv_cache.shape[1]
    tokens = kv_blocks(kv_cache).permute(0, 3, 1, 2, 4)  # (num_blocks, block_size, 2, Hk, D), strided
    new = torch.stack((k, v), dim=1)  # (num_tokens, 2, Hk, D)
    new = quantize_rows(new) if kv_cache.dtype == torch.int8 else new.to(kv_cache.dtype)
    tokens.index_put_((slot_mapping // block_size, slot_mapping % block_size), new)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the step's queries over each sequence's cached context.

    q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim).
    kv_cache: (num_blocks, block_size, 2, num_kv_heads, head_dim), used block-major (see
    `kv_blocks`). window: a query at position p attends keys at positions > p - window (None: all
    up to p); softcap: scores become softcap * tanh(score / softcap) before the softmax.
    Returns (num_tokens, num_heads, head_dim).
    """
    if kernel_serves(q, kv_cache) and k.stride(-1) == 1 and v.stride(-1) == 1:
        cpu_kernels.write_kv_blocks(kv_cache, k, v, meta.slot_mapping)  # one pass, not four ops
        return cpu_kernels.paged_attention(
            q, kv_cache, meta.block_table, meta.seq_lens, meta.query_start, scale, window=window, softcap=softcap
        )
    store_kv(kv_cache, k, v, meta.slot_mapping)
    if len(meta.groups) == 1 and meta.groups[0].token_range == (0, meta.num_tokens):
        return _attend(q, k, v, kv_cache, meta.groups[0], scale, window, softcap).reshape(q.shape)
    out = q.new_empty(q.shape)
    for group in meta.groups:
        unpad_into(out, _attend(q, k, v, kv_cache, group, scale, window, softcap), group)
    return out


def kernel_serves(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether our C++ kernel attends these queries over this cache: on CPU, when built, for one
    16/32-bit dtype, a 16-bit cache under float32 queries, or an int8 cache under any."""
    reads = (
        q.dtype == kv_cache.dtype
        or kv_cache.dtype == torch.int8
        or (q.dtype == torch.float32 and kv_cache.dtype in (torch.float16, torch.bfloat16))
    )
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and reads
        and q.stride(-1) == 1
        and cpu_kernels.available()
    )


def _gather_blocks(kv_cache: torch.Tensor, group: AttentionGroup, dtype: torch.dtype) -> torch.Tensor:
    """(2, Hk, n, max_kv, D) in `dtype`: the group's keys and values, one copy out of the blocks
    (an `index_select` of whole blocks along the block dim of a view that puts it third), into the
    group's buffers; an int8 cache's gathered blocks are dequantized."""
    num_blocks, _, num_kv_heads, block_size, head_dim = kv_blocks(kv_cache).shape
    runs = kv_cache.view(num_blocks, 2, num_kv_heads, block_size * head_dim).permute(1, 2, 0, 3)
    index = group.block_table.view(-1)
    kv = group.buffer((2, num_kv_heads, index.numel(), block_size * head_dim), kv_cache.dtype, kv_cache.device)
    torch.index_select(runs, 2, index, out=kv)  # (2, Hk, n * blocks per seq, block_size * D)
    if kv_cache.dtype == torch.int8:
        return dequantize_rows(kv.view(2, num_kv_heads, group.num_seqs, -1, head_dim), dtype)
    return _as_dtype(kv, group, dtype).view(2, num_kv_heads, group.num_seqs, -1, head_dim)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """-> (num_seqs, max_query_len, num_heads, head_dim) for the group's padded queries."""
    if group.max_query_len == 1:
        return _decode(pad_queries(q, group), kv_cache, group, scale, window, softcap)
    queries = pad_queries(q, group).transpose(1, 2)  # (n, num_heads, max_q, head_dim)
    if window is not None or softcap is not None:
        kv = _gather_blocks(kv_cache, group, q.dtype).transpose(1, 2)  # (2, n, Hk, max_kv, D)
        mask = group.windowed(window)[0]
        if softcap is None:
            out = F.scaled_dot_product_attention(queries, kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            out = _softcapped(queries, kv[0], kv[1], mask, scale, softcap)
    elif group.is_fresh and kv_cache.dtype != torch.int8:  # int8: the cache's keys, as the kernel reads
        keys = pad_queries(k, group).transpose(1, 2)  # (n, num_kv_heads, max_q, head_dim)
        values = pad_queries(v, group).transpose(1, 2)
        # Padding keys sit after every real query of their sequence: causal hides them.
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kv = _gather_blocks(kv_cache, group, q.dtype).transpose(1, 2)  # (2, n, Hk, max_kv, D)
        out = F.scaled_dot_product_attention(
            queries, kv[0], kv[1], attn_mask=group.mask, scale=scale, enable_gqa=True
        )  # (n, num_heads, max_q, head_dim)
    return out.transpose(1, 2)


def _softcapped(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Masked attention with soft-capped scores, in transformers' order (scale, / cap, tanh, * cap,
    softmax in float32): queries (n, H, max_q, D), keys and values (n, Hk, max_kv, D), mask
    (n, 1, max_q, max_kv) -> (n, H, max_q, D)."""
    n, num_heads, max_q, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    rows = queries.reshape(n, num_kv_heads, group * max_q, head_dim)  # query heads of a KV head are rows
    scores = torch.matmul(rows, keys.transpose(-1, -2)) * scale  # (n, Hk, G * max_q, max_kv)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(n, num_kv_heads, group, max_q, -1).masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(queries.dtype)
    out = torch.matmul(probs.view(n, num_kv_heads, group * max_q, -1), values)  # (n, Hk, G * max_q, D)
    return out.view(n, num_heads, max_q, head_dim)


def _decode(
    queries: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """queries (n, 1, num_heads, head_dim) -> (n, 1, num_heads, head_dim).

    The query heads sharing a KV head become the rows of one small matmul per
    (KV head, sequence), so GQA needs no repeated keys. These run on oneDNN whatever the
    step's kernels (meta.kernels): for many tiny batched products it stays the faster.
    """
    n, _, num_heads, head_dim = queries.shape
    kv = _gather_blocks(kv_cache, group, queries.dtype)  # (2, Hk, n, max_kv, D)
    num_kv_heads = kv.shape[1]
    rows = queries.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)  # (Hk, n, G, D)
    # matmul over (Hk, n) batch dims that cannot be merged is ~1.5x slower than copying the rows.
    scores = torch.matmul(rows.contiguous(), kv[0].transpose(-1, -2))  # (Hk, n, G, max_kv)
    bias = group.windowed(window)[1]
    assert bias is not None  # a decode group (max_query_len 1) has its mask as a bias too
    if softcap is not None:  # transformers' order: scale, / cap, tanh, * cap, then the mask
        scores = torch.tanh(scores * scale / softcap) * softcap
        probs = torch.add(bias, scores).softmax(dim=-1).to(queries.dtype)
    else:
        # bias + scale * scores in float32: masked keys get exactly zero weight.
        probs = torch.add(bias, scores, alpha=scale).softmax(dim=-1).to(queries.dtype)
    out = torch.matmul(probs, kv[1])  # (Hk, n, G, D)
    return out.transpose(0, 1).reshape(n, 1, num_heads, head_dim)
