"""Paged attention in plain PyTorch: the runner builds `AttentionMetadata` once per
step, every layer reuses it.

The KV cache of one layer is a tensor of shape (num_blocks, block_size, *entry_shape);
flattened, slot `s = block_id * block_size + offset` holds one token's entry.

    block_table of a sequence:  [7, 2, 9]          block_size = 4
    its token t lives at slot:  block_table[t // 4] * 4 + t % 4
    token 5 -> block 2, offset 1 -> slot 9

Sequences with one query token (decodes) and sequences with several (prefill
chunks) go into separate `AttentionGroup`s so that a long prompt does not pad
every decode up to its length.  Each group is attended with one batched call:
keys are gathered through the block table into (num_seqs, max_kv_len, ...) and a
boolean mask hides padding and future tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class KVCacheSpec:
    """What a model stores per token per layer; the block manager only sees blocks."""

    num_layers: int
    entry_shape: tuple[int, ...]  # GQA: (2, num_kv_heads, head_dim); MLA: (kv_lora_rank + qk_rope_head_dim,)
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        numel = 1
        for dim in self.entry_shape:
            numel *= dim
        return self.num_layers * numel * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, block_size: int, device: torch.device | str) -> list[torch.Tensor]:
        return [
            torch.zeros((num_blocks, block_size, *self.entry_shape), dtype=self.dtype, device=device)
            for _ in range(self.num_layers)
        ]


@dataclass
class AttentionGroup:
    """Sequences attended together in one padded batched call."""

    token_index: torch.Tensor  # (num_group_tokens,) rows of the flat token batch in this group
    padded_index: torch.Tensor  # (num_group_tokens,) where each row goes in (num_seqs * max_query_len)
    num_seqs: int
    max_query_len: int
    kv_slots: torch.Tensor  # (num_seqs, max_kv_len) flat cache slots to gather (padding -> slot 0)
    mask: torch.Tensor  # (num_seqs, 1, max_query_len, max_kv_len) True = may attend


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step. Built by the runner, read by every layer."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64 cache slot that each new token's K/V is written to
    groups: list[AttentionGroup]
    num_tokens: int

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """query_lens[i] new tokens of sequence i sit at the end of its seq_lens[i] tokens.

        Tokens are laid out flat, sequence after sequence, in the order given.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        starts, offset = [], 0
        for q in query_lens:
            starts.append(offset)
            offset += q
        slot_mapping = []
        for q, s, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s - q, s):
                slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        prefill = [i for i, q in enumerate(query_lens) if q > 1]
        groups = [
            _build_group(idx, starts, query_lens, seq_lens, block_tables, block_size, device)
            for idx in (decode, prefill)
            if idx
        ]
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            groups=groups,
            num_tokens=offset,
        )


def _build_group(seq_idx, starts, query_lens, seq_lens, block_tables, block_size, device) -> AttentionGroup:
    max_q = max(query_lens[i] for i in seq_idx)
    max_kv = max(seq_lens[i] for i in seq_idx)
    n = len(seq_idx)
    token_index, padded_index = [], []
    for row, i in enumerate(seq_idx):
        token_index.extend(range(starts[i], starts[i] + query_lens[i]))
        padded_index.extend(range(row * max_q, row * max_q + query_lens[i]))
    pos = torch.arange(max_kv)
    num_blocks = (max_kv + block_size - 1) // block_size
    tables = torch.zeros((n, num_blocks), dtype=torch.int64)
    for row, i in enumerate(seq_idx):
        used = (seq_lens[i] + block_size - 1) // block_size
        tables[row, :used] = torch.tensor(block_tables[i][:used], dtype=torch.int64)
    kv_slots = tables[:, pos // block_size] * block_size + pos % block_size  # (n, max_kv)
    seq_len_t = torch.tensor([seq_lens[i] for i in seq_idx])
    q_len_t = torch.tensor([query_lens[i] for i in seq_idx])
    # Query j of a sequence sits at absolute position seq_len - q_len + j; it sees keys at <= that.
    q_pos = (seq_len_t - q_len_t)[:, None] + torch.arange(max_q)[None, :]  # (n, max_q)
    mask = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < seq_len_t[:, None, None])
    # Padding query rows must see at least one key or softmax yields NaN; their output is dropped.
    mask[:, :, 0] = True
    kv_slots = kv_slots.masked_fill(pos[None, :] >= seq_len_t[:, None], 0)
    return AttentionGroup(
        token_index=torch.tensor(token_index, dtype=torch.int64, device=device),
        padded_index=torch.tensor(padded_index, dtype=torch.int64, device=device),
        num_seqs=n,
        max_query_len=max_q,
        kv_slots=kv_slots.to(device),
        mask=mask[:, None].to(device),  # (n, 1, max_q, max_kv)
    )


def write_kv(kv_cache: torch.Tensor, entries: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's cache entry (num_tokens, *entry_shape) at its slot."""
    flat = kv_cache.view(-1, *kv_cache.shape[2:])  # (num_slots, *entry_shape)
    flat.index_copy_(0, slot_mapping, entries.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """(num_seqs, max_kv_len, *entry_shape) entries of the group's sequences, in position order."""
    flat = kv_cache.view(-1, *kv_cache.shape[2:])
    return flat[group.kv_slots]


def pad_queries(x: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """Rows of the flat batch (num_tokens, ...) -> (num_seqs, max_query_len, ...) for this group."""
    padded = x.new_zeros((group.num_seqs * group.max_query_len, *x.shape[1:]))
    padded[group.padded_index] = x[group.token_index]
    return padded.view(group.num_seqs, group.max_query_len, *x.shape[1:])


def unpad_into(out: torch.Tensor, padded: torch.Tensor, group: AttentionGroup) -> None:
    """Inverse of pad_queries: scatter the group's real rows back into the flat output."""
    flat = padded.reshape(group.num_seqs * group.max_query_len, *padded.shape[2:])
    out[group.token_index] = flat[group.padded_index]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the step's queries over each sequence's cached context.

    q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim).
    kv_cache: (num_blocks, block_size, 2, num_kv_heads, head_dim). Returns (num_tokens, num_heads, head_dim).
    """
    write_kv(kv_cache, torch.stack((k, v), dim=1), meta.slot_mapping)
    out = torch.empty_like(q)
    for group in meta.groups:
        kv = gather_kv(kv_cache, group).to(q.dtype)  # (n, max_kv, 2, num_kv_heads, head_dim)
        keys = kv[:, :, 0].transpose(1, 2)  # (n, num_kv_heads, max_kv, head_dim)
        values = kv[:, :, 1].transpose(1, 2)
        queries = pad_queries(q, group).transpose(1, 2)  # (n, num_heads, max_q, head_dim)
        attn = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.mask, scale=scale, enable_gqa=True
        )  # (n, num_heads, max_q, head_dim)
        unpad_into(out, attn.transpose(1, 2), group)
    return out
