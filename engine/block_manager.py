"""The KV block pool: free list, reference counts, per-request block tables, prefix cache.

No torch here: blocks are integers, the runner maps them to cache tensors.

Every block is in exactly one of three states:

    free       ref 0, no hash      taken first by allocations
    cached     ref 0, hashed       reusable by a request with the same prefix,
                                   evicted least-recently-freed first when free runs out
    held       ref >= 1            in the block table of ref requests

A full block is identified by a chained hash of its tokens and of every token
before it, so equal hashes mean equal prefixes:

    tokens:  [t0 .. t15] [t16 .. t31] [t32 .. t40]
    hashes:   h0 = H(root, t0..15)   h1 = H(h0, t16..31)   (partial block: no hash)

A request's `cache_salt` (vLLM's) goes into its root, h0 = H(root, salt, t0..15): requests with
different salts (or one salted, one not) share no block.

A block's hash is registered only once its KV has been computed (`cache_blocks`,
called after the forward pass), so a failed step never leaves garbage in the cache.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from typing import Iterable

from engine.request import Request

_ROOT = b"pagedserve-prefix-root"


def hash_block(parent: int | None, token_ids: Iterable[int], salt: str | None = None) -> int:
    """128-bit blake2b of the parent block's hash (or the root, salted for a first block) and this
    block's token ids."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent.to_bytes(16, "little"))
    else:
        h.update(_ROOT)
        if salt is not None:  # its length first: salt and tokens cannot run into each other
            data = salt.encode("utf-8", "surrogatepass")  # any str (the server refuses lone surrogates)
            h.update(len(data).to_bytes(8, "little") + data)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is taken first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached with ref 0, oldest first
        self._cached: dict[int, int] = {}  # hash -> block id
        self._tables: dict[str, list[int]] = {}  # request id -> block table
        self._num_cached_blocks: dict[str, int] = {}  # request id -> leading blocks already registered
        # Prefix cache counters, in prompt tokens, counted once per admission.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable prefix, whether a request holds them or not."""
        return len(self._cached)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ prefix cache
    def _hash_blocks(self, request: Request) -> list[int]:
        """Extend request.block_hashes to cover every full block of its tokens."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs],
                                     request.params.cache_salt))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix (nothing is changed).

        The match stops one token short of the end: the last token must be computed
        so that the step produces logits for it.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self._hash_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for h in hashes[:max_blocks]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def next_block_hash(self, request: Request, num_hit_blocks: int) -> int | None:
        """Hash of the first block after a prefix hit, if that block could be a hit too."""
        if not self.enable_prefix_caching or num_hit_blocks >= (request.num_tokens - 1) // self.block_size:
            return None
        return self._hash_blocks(request)[num_hit_blocks]

    def hashes_to_cache(self, request: Request, num_tokens: int) -> list[int]:
        """Hashes that `cache_blocks(request, num_tokens)` would register."""
        if not self.enable_prefix_caching:
            return []
        start = self._num_cached_blocks.get(request.request_id, 0)
        return self._hash_blocks(request)[start : num_tokens // self.block_size]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables[rid]
        hashes = self._hash_blocks(request)
        start = self._num_cached_blocks[rid]
        end = min(num_computed_tokens // self.block_size, len(table))
        for i in range(start, end):
            block_id, h = table[i], hashes[i]
            # A block reused from the cache already carries h; a block computed twice
            # (two requests with the same prefix in flight) keeps only the first copy.
            if self.block_hashes[block_id] is None and h not in self._cached:
                self.block_hashes[block_id] = h
                self._cached[h] = block_id
        self._num_cached_blocks[rid] = max(start, end)

    # ------------------------------------------------------------------- verbs
    def can_allocate(self, request: Request, num_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Whether the request's table can grow to hold num_tokens tokens."""
        have = len(self._tables.get(request.request_id, ())) + len(computed_blocks)
        # Hits sitting in the evictable pool stop being allocatable once we hold them.
        reused_evictable = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        return self.blocks_needed(num_tokens) - have <= self.num_free_blocks - reused_evictable

    def allocate(self, request: Request, computed_blocks: list[int], num_tokens: int) -> list[int] | None:
        """Give a newly admitted request a table: its prefix hits, then fresh blocks up to num_tokens.

        Returns the block table, or None (and changes nothing) when the pool is short.
        """
        rid = request.request_id
        if rid in self._tables:
            raise ValueError(f"request {rid!r} already holds blocks")
        if not self.can_allocate(request, num_tokens, computed_blocks):
            return None
        for block_id in computed_blocks:
            if self.ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self.ref_counts[block_id] += 1
        num_new = self.blocks_needed(num_tokens) - len(computed_blocks)
        self._tables[rid] = list(computed_blocks) + [self._take_block() for _ in range(num_new)]
        self._num_cached_blocks[rid] = len(computed_blocks)
        if self.enable_prefix_caching:
            self.num_prefix_queries += request.num_tokens
            self.num_prefix_hits += len(computed_blocks) * self.block_size
        return self._tables[rid]

    def append_slots(self, request: Request, num_tokens: int) -> list[int] | None:
        """Grow a running request's table to hold num_tokens tokens; None when the pool is short."""
        table = self._tables[request.request_id]
        num_new = self.blocks_needed(num_tokens) - len(table)
        if num_new > self.num_free_blocks:
            return None
        table.extend(self._take_block() for _ in range(num_new))
        return table

    def free(self, request: Request) -> None:
        """Release every block of the request (no-op if it holds none)."""
        table = self._tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table is None:
            return
        # Tail first: the end of a sequence is the least likely to be shared, so it is
        # the first to be evicted (evictable is ordered oldest first).
        for block_id in reversed(table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None

    def _take_block(self) -> int:
        if self._free:
            block_id = self._free.pop()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            del self._cached[self.block_hashes[block_id]]
            self.block_hashes[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    # ------------------------------------------------------------------- audit
    def audit(self) -> list[str]:
        """Reconcile the pool; returns one line per discrepancy (empty when consistent)."""
        issues = []
        free, evictable = set(self._free), set(self._evictable)
        held = {b for b in range(self.num_blocks) if self.ref_counts[b] > 0}
        if len(free) != len(self._free):
            issues.append("a block appears twice in the free list")
        if free & evictable or free & held or evictable & held:
            issues.append(f"blocks in two states: {sorted((free & evictable) | (free & held) | (evictable & held))}")
        if len(free) + len(evictable) + len(held) != self.num_blocks:
            issues.append(
                f"free {len(free)} + cached {len(evictable)} + held {len(held)} != total {self.num_blocks}"
            )
        holders = Counter(b for table in self._tables.values() for b in table)
        for block_id in range(self.num_blocks):
            if self.ref_counts[block_id] != holders[block_id]:
                issues.append(
                    f"block {block_id}: ref count {self.ref_counts[block_id]} but {holders[block_id]} holders"
                )
        for block_id in free:
            if self.block_hashes[block_id] is not None:
                issues.append(f"free block {block_id} still carries a hash")
        for block_id in evictable:
            if self.block_hashes[block_id] is None:
                issues.append(f"evictable block {block_id} has no hash")
        for h, block_id in self._cached.items():
            if self.block_hashes[block_id] != h:
                issues.append(f"cache entry for block {block_id} does not match its hash")
        if sum(h is not None for h in self.block_hashes) != len(self._cached):
            issues.append("hashed blocks and cache entries differ in number")
        for rid, table in self._tables.items():
            if len(set(table)) != len(table):
                issues.append(f"request {rid!r} holds a block twice")
        return issues
