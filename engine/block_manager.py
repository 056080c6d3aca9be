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
different salts (or one salted, one not) share no block. So does its LoRA adapter's name
(h0 = H(root, salt, "lora", name, t0..15)): an adapter's KV is its own.

A block's hash is registered only once its KV has been computed (`cache_blocks`,
called after the forward pass), so a failed step never leaves garbage in the cache.

KV cache groups (vLLM's hybrid KV cache manager). A model whose layers attend differently, some
over the whole context and some within a sliding window, has one group per kind of layer (and as
many groups of a kind as it takes to keep every group the same number of layers: the runner gives
block b of every group the same bytes). Each request holds one block table per group, all from one
pool. A sliding group's table drops the blocks that have left the window of the next query:

    window 8, block_size 4, 14 tokens computed: the next query (position 14) sees 7..14
    full group     [3, 8, 2, 5]
    sliding group  [0, 9, 4, 6]      block 0 is the null block: never allocated, never written

so a sliding layer holds about window / block_size blocks a request however long its context. A
prefix hit must then find, in a sliding group, only the blocks of the window before its end.

A lower tier (engine/kv_disk.py) below the cache: a cached block is saved there when it is
evicted (and at shutdown, `save_cached`), and a prefix that misses memory but is found there is
read back into fresh blocks, which become cached blocks like any other, before the match:

    memory  [h0 h1]                    disk  [h2 h3]       request h0 h1 h2 h3 h4
    promote: h2, h3 read into two free blocks -> memory [h0 h1 h2 h3] -> a hit of 4 blocks

Blocks of a LoRA adapter stay in memory: an adapter's cache key names a load of it in this
process only.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from typing import Callable, Iterable, Protocol, Sequence

from engine.request import Request

_ROOT = b"pagedserve-prefix-root"
_LORA_TAG = b"pagedserve-lora-adapter"
NULL_BLOCK = 0  # a sliding group's table entry for a block left behind by the window


def hash_block(
    parent: int | None, token_ids: Iterable[int], salt: str | None = None, lora_name: str | None = None
) -> int:
    """128-bit blake2b of the parent block's hash (or the root, salted and with the LoRA adapter's
    name for a first block) and this block's token ids."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent.to_bytes(16, "little"))
    else:
        h.update(_ROOT)
        if salt is not None:  # its length first: salt and tokens cannot run into each other
            data = salt.encode("utf-8", "surrogatepass")  # any str (the server refuses lone surrogates)
            h.update(len(data).to_bytes(8, "little") + data)
        if lora_name is not None:  # a tag, so that no salt reads the same
            data = lora_name.encode("utf-8", "surrogatepass")
            h.update(_LORA_TAG + len(data).to_bytes(8, "little") + data)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class LowerTier(Protocol):
    """Where evicted cached blocks go and prefix misses are looked up (engine/kv_disk.py)."""

    def contains(self, key: tuple[int, int]) -> bool: ...

    def save(self, block_id: int, key: tuple[int, int], wait: bool = False) -> None: ...

    def load(self, block_id: int, key: tuple[int, int]) -> bool: ...


class BlockManager:
    """windows: one entry per KV cache group, None for layers that see the whole context, else
    the sliding window (a query at position p sees keys at positions > p - window)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: tuple[int | None, ...] = (None,),
        lower_tier: LowerTier | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"need one window (None or at least 1) per KV cache group, got {windows}")
        self.windows = tuple(windows)
        # Sliding groups point the blocks they drop at a null block, kept out of the pool.
        self.null_block = NULL_BLOCK if any(w is not None for w in windows) else None
        if self.null_block is not None and num_blocks < 2:
            raise ValueError(f"a model with sliding-window layers needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # (group, hash) of a cached block: a group's blocks hold its own layers' KV.
        self.block_hashes: list[tuple[int, int] | None] = [None] * num_blocks
        first = 0 if self.null_block is None else 1
        self._free = list(range(num_blocks - 1, first - 1, -1))  # a stack: the lowest block is taken first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached with ref 0, oldest first
        self._cached: dict[tuple[int, int], int] = {}  # (group, hash) -> block id
        self._tables: dict[str, list[list[int]]] = {}  # request id -> one block table per group
        self._num_cached_blocks: dict[str, int] = {}  # request id -> leading blocks already registered
        # Prefix cache counters, in prompt tokens, counted once per admission.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_prefix_lower_tier_hits = 0  # of those, read back from the lower tier
        self.lower_tier = lower_tier if enable_prefix_caching else None
        self._promoted: set[int] = set()  # blocks read back from the lower tier, not yet hit
        self._volatile: set[tuple[int, int]] = set()  # cached keys that never leave memory (LoRA)

    # ----------------------------------------------------------------- queries
    @property
    def num_usable_blocks(self) -> int:
        """Blocks the pool can hand out (all but the null block)."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable prefix, whether a request holds them or not."""
        return len(self._cached)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        return self._tables[request_id][group]

    def block_tables(self, request_id: str) -> list[list[int]]:
        return self._tables[request_id]

    def num_held_blocks(self, group: int) -> int:
        """Blocks the running requests' tables of this group hold (null entries aside)."""
        return sum(b != self.null_block for tables in self._tables.values() for b in tables[group])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_needed(self, group: int, next_position: int) -> int:
        """The first block of the group that a query at next_position or later still reads."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, next_position - window + 1) // self.block_size

    # ------------------------------------------------------------ prefix cache
    def _hash_blocks(self, request: Request) -> list[int]:
        """Extend request.block_hashes to cover every full block of its tokens."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(
                hash_block(
                    hashes[-1] if hashes else None,
                    tokens[i * bs : (i + 1) * bs],
                    request.params.cache_salt,
                    request.lora_cache_key,
                )
            )
        return hashes

    def get_computed_blocks(self, request: Request) -> list[list[int]]:
        """Per group, the cached blocks of the request's longest cached prefix (nothing is
        changed); every list has one entry per block of the prefix, a sliding group's
        null_block for those before its window.

        The match stops one token short of the end: the last token must be computed
        so that the step produces logits for it.
        """
        none: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching:
            return none
        hashes = self._hash_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.lower_tier is not None and request.lora_cache_key is None:
            self._promote(hashes, max_blocks)
        length = self._match(hashes, max_blocks, self._cached.__contains__)
        if length == 0:
            return none
        return [
            [
                self._cached[(g, h)] if i >= self._first_needed(g, length * self.block_size) else NULL_BLOCK
                for i, h in enumerate(hashes[:length])
            ]
            for g in range(len(self.windows))
        ]

    def _match(self, hashes: list[int], max_blocks: int, has: Callable[[tuple[int, int]], bool]) -> int:
        """The longest prefix, in blocks, whose blocks a query after it reads are all found by `has`."""
        # Full groups need every block of the prefix; sliding ones only their window's.
        length = max_blocks
        for group, window in enumerate(self.windows):
            if window is None:
                length = next((i for i, h in enumerate(hashes[:length]) if not has((group, h))), length)
        valid = [True] * (length + 1)
        for group, window in enumerate(self.windows):
            if window is not None:
                valid = [a and b for a, b in zip(valid, self._window_hits(group, hashes, length, has))]
        return max(n for n, ok in enumerate(valid) if ok)

    def _promote(self, hashes: list[int], max_blocks: int) -> None:
        """Read back from the lower tier the blocks of the longest prefix found in memory and there
        together, as cached blocks; only when the pool has room for them without evicting the
        prefix's own blocks. A block that cannot be read (an unsound file) ends the prefix there."""
        assert self.lower_tier is not None
        tier = self.lower_tier
        length = self._match(hashes, max_blocks, lambda key: key in self._cached or tier.contains(key))
        keys = [
            (g, hashes[i])
            for i in range(length)
            for g in range(len(self.windows))
            if i >= self._first_needed(g, length * self.block_size)
        ]  # prefix order: a failed read leaves the blocks before it usable
        missing = [key for key in keys if key not in self._cached]
        if not missing:
            return
        present = [self._cached[key] for key in keys if key in self._cached]
        held = [b for b in present if self.ref_counts[b] == 0]
        if len(missing) > self.num_free_blocks - len(held):
            return
        for block_id in held:  # out of the evictable pool while we take blocks
            del self._evictable[block_id]
            self.ref_counts[block_id] = 1
        for key in missing:
            block_id = self._take_block()
            loaded = tier.load(block_id, key)
            if loaded:
                self.block_hashes[block_id] = key
                self._cached[key] = block_id
                self._promoted.add(block_id)
            self._release(block_id)
            if not loaded:
                break
        for block_id in held:
            self._release(block_id)

    def _window_hits(
        self, group: int, hashes: list[int], max_length: int, has: Callable[[tuple[int, int]], bool]
    ) -> list[bool]:
        """For each prefix length n (in blocks, 0..max_length), whether this sliding group has
        cached every block that a query after the prefix reads: one pass over the blocks."""
        valid = [True] + [False] * max_length
        run_start = 0  # first block of the run of cached blocks that ends at block n - 1
        for n in range(1, max_length + 1):
            if not has((group, hashes[n - 1])):
                run_start = n
            else:
                valid[n] = run_start <= self._first_needed(group, n * self.block_size)
        return valid

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
        tables = self._tables[rid]
        hashes = self._hash_blocks(request)
        start = self._num_cached_blocks[rid]
        end = min(num_computed_tokens // self.block_size, len(tables[0]))
        for group, table in enumerate(tables):
            for i in range(start, end):
                block_id, key = table[i], (group, hashes[i])
                # A block reused from the cache already carries its key; a block computed twice
                # (two requests with the same prefix in flight) keeps only the first copy.
                if block_id != self.null_block and self.block_hashes[block_id] is None and key not in self._cached:
                    self.block_hashes[block_id] = key
                    self._cached[key] = block_id
                    if request.lora_cache_key is not None:
                        self._volatile.add(key)
        self._num_cached_blocks[rid] = max(start, end)

    # ------------------------------------------------------------------- verbs
    def _num_new_blocks(self, tables: Sequence[list[int]], num_tokens: int) -> int:
        return sum(max(0, self.blocks_needed(num_tokens) - len(t)) for t in tables)

    def can_allocate(self, request: Request, num_tokens: int, computed_blocks: Sequence[list[int]] = ()) -> bool:
        """Whether the request's tables can grow to hold num_tokens tokens."""
        tables = self._tables.get(request.request_id) or computed_blocks or [[] for _ in self.windows]
        # Hits sitting in the evictable pool stop being allocatable once we hold them.
        reused_evictable = sum(
            1 for t in computed_blocks for b in t if b != self.null_block and self.ref_counts[b] == 0
        )
        return self._num_new_blocks(tables, num_tokens) <= self.num_free_blocks - reused_evictable

    def allocate(self, request: Request, computed_blocks: list[list[int]], num_tokens: int) -> list[list[int]] | None:
        """Give a newly admitted request its tables: its prefix hits (from get_computed_blocks, or
        empty), then fresh blocks up to num_tokens.

        Returns the block tables, or None (and changes nothing) when the pool is short.
        """
        rid = request.request_id
        if rid in self._tables:
            raise ValueError(f"request {rid!r} already holds blocks")
        computed_blocks = [list(t) for t in computed_blocks] or [[] for _ in self.windows]
        if not self.can_allocate(request, num_tokens, computed_blocks):
            return None
        for block_id in (b for t in computed_blocks for b in t if b != self.null_block):
            if self.ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self.ref_counts[block_id] += 1
        num_hit = len(computed_blocks[0])
        self._tables[rid] = computed_blocks
        self._grow(computed_blocks, num_tokens)
        self._num_cached_blocks[rid] = num_hit
        if self.enable_prefix_caching:
            self.num_prefix_queries += request.num_tokens
            self.num_prefix_hits += num_hit * self.block_size
            if self._promoted:
                promoted = [any(t[i] in self._promoted for t in computed_blocks) for i in range(num_hit)]
                self.num_prefix_lower_tier_hits += sum(promoted) * self.block_size
                self._promoted.difference_update(b for t in computed_blocks for b in t)
        return self._tables[rid]

    def append_slots(self, request: Request, num_tokens: int) -> list[list[int]] | None:
        """Grow a running request's tables to hold num_tokens tokens, after letting its sliding
        groups drop what has left their window; None when the pool is short."""
        tables = self._tables[request.request_id]
        self.release_outside_window(request)
        if self._num_new_blocks(tables, num_tokens) > self.num_free_blocks:
            return None
        self._grow(tables, num_tokens)
        return tables

    def release_outside_window(self, request: Request) -> None:
        """Hand back the blocks of the request's sliding groups that no query from its next token
        on reads (a cached one stays a prefix-cache entry until evicted)."""
        tables = self._tables[request.request_id]
        for group, table in enumerate(tables):
            if self.windows[group] is None:
                continue
            for i in range(min(self._first_needed(group, request.num_computed_tokens), len(table))):
                if table[i] != NULL_BLOCK:
                    self._release(table[i])
                    table[i] = NULL_BLOCK

    def _grow(self, tables: list[list[int]], num_tokens: int) -> None:
        need = self.blocks_needed(num_tokens)
        for table in tables:
            table.extend(self._take_block() for _ in range(need - len(table)))

    def free(self, request: Request) -> None:
        """Release every block of the request (no-op if it holds none)."""
        tables = self._tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if tables is None:
            return
        # Tail first: the end of a sequence is the least likely to be shared, so it is
        # the first to be evicted (evictable is ordered oldest first).
        for table in tables:
            for block_id in reversed(table):
                if block_id != self.null_block:
                    self._release(block_id)

    def _release(self, block_id: int) -> None:
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
            key = self.block_hashes[block_id]
            assert key is not None  # only a cached block is evictable
            if self.lower_tier is not None and key not in self._volatile:
                self.lower_tier.save(block_id, key)  # its bytes copied out before the block is reused
            del self._cached[key]
            self._volatile.discard(key)
            self._promoted.discard(block_id)
            self.block_hashes[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def save_cached(self) -> None:
        """Save every cached block to the lower tier, waiting for room in its queue (shutdown)."""
        if self.lower_tier is None:
            return
        for key, block_id in self._cached.items():
            if key not in self._volatile:
                self.lower_tier.save(block_id, key, wait=True)

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
        if len(free) + len(evictable) + len(held) != self.num_usable_blocks:
            issues.append(
                f"free {len(free)} + cached {len(evictable)} + held {len(held)} != total {self.num_usable_blocks}"
            )
        if self.null_block is not None and (
            self.null_block in free | evictable | held or self.block_hashes[self.null_block] is not None
        ):
            issues.append(f"the null block {self.null_block} is in the pool")
        holders = Counter(b for tables in self._tables.values() for t in tables for b in t if b != self.null_block)
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
        for key, block_id in self._cached.items():
            if self.block_hashes[block_id] != key:
                issues.append(f"cache entry for block {block_id} does not match its hash")
        if sum(h is not None for h in self.block_hashes) != len(self._cached):
            issues.append("hashed blocks and cache entries differ in number")
        for rid, tables in self._tables.items():
            if len({len(t) for t in tables}) != 1:
                issues.append(f"request {rid!r} holds tables of different lengths")
            real = [b for t in tables for b in t if b != self.null_block]
            if len(set(real)) != len(real):
                issues.append(f"request {rid!r} holds a block twice")
        return issues
