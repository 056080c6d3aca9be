"""The block pool on its own: ref counts, prefix hashes, LRU eviction, audit. No torch."""

import pytest

from engine.block_manager import BlockManager, hash_block
from engine.request import Request, SamplingParams

BS = 4


def make_request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def compute_all(bm, request, num_tokens=None):
    """Allocate with prefix hits, then mark everything computed (what a step would do)."""
    num_tokens = request.num_tokens if num_tokens is None else num_tokens
    hits = bm.get_computed_blocks(request)
    tables = bm.allocate(request, hits, num_tokens)
    assert tables is not None
    bm.cache_blocks(request, num_tokens)
    assert bm.audit() == []
    return hits[0], tables[0]


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", range(10)), make_request("b", range(100, 105))
    assert bm.allocate(a, [], 10) is not None and len(bm.block_table("a")) == 3
    assert bm.allocate(b, [], 5) is not None
    assert bm.num_free_blocks == 3 and bm.audit() == []
    assert bm.append_slots(b, 9) == [bm.block_table("b")] and len(bm.block_table("b")) == 3
    bm.free(a)
    bm.free(b)
    bm.free(b)  # freeing twice is a no-op
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0 and bm.audit() == []


def test_allocation_failure_is_none_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request("a", range(8))
    assert bm.allocate(a, [], 8) is not None
    b = make_request("b", range(50, 58))
    assert not bm.can_allocate(b, 8)
    assert bm.allocate(b, [], 8) is None
    assert bm.append_slots(a, 20) is None
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 1 and bm.audit() == []


def test_chained_hash_depends_on_everything_before():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == h0
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 5]) != h0


def test_a_cache_salt_keeps_prefixes_apart():
    """vLLM's cache_salt: the same tokens under different salts (or none) hash apart from the first
    block on, so one salt's cached blocks never serve another's request; the same salt shares them."""
    assert hash_block(None, [1, 2, 3, 4], "a") != hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4], "a") != hash_block(None, [1, 2, 3, 4], "b")
    assert hash_block(None, [1, 2, 3, 4], "a") == hash_block(None, [1, 2, 3, 4], "a")
    assert hash_block(7, [1, 2, 3, 4], "a") == hash_block(7, [1, 2, 3, 4])  # the salt is in the root only
    assert hash_block(None, [1], "\ud800") != hash_block(None, [1], "\ud801")  # any str, lone surrogates too
    bm = BlockManager(num_blocks=16, block_size=BS)

    def salted(rid, salt):
        return Request(rid, list(range(9)), SamplingParams(max_tokens=4, cache_salt=salt))

    compute_all(bm, salted("a", "tenant-a"))
    assert bm.get_computed_blocks(salted("b", "tenant-b")) == [[]]
    assert bm.get_computed_blocks(make_request("c", range(9))) == [[]]
    assert bm.get_computed_blocks(salted("d", "tenant-a")) == [bm.block_table("a")[:2]]
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", range(14))  # 3 full blocks + 2 tokens
    compute_all(bm, a)
    b = make_request("b", list(range(12)) + [99, 98, 97])
    hits, table = compute_all(bm, b)
    assert hits == bm.block_table("a")[:3] and table[:3] == hits
    assert [bm.ref_counts[x] for x in hits] == [2, 2, 2]
    assert bm.num_prefix_queries == 14 + 15 and bm.num_prefix_hits == 12
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16 and bm.audit() == []


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=16, block_size=BS)
    compute_all(bm, make_request("a", range(8)))
    # Same 8 tokens: only the first block may hit, the last token must be computed.
    assert len(bm.get_computed_blocks(make_request("b", range(8)))[0]) == 1
    assert len(bm.get_computed_blocks(make_request("c", range(9)))[0]) == 2


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = make_request("old", range(0, 5))
    compute_all(bm, old)
    bm.free(old)
    new = make_request("new", range(100, 105))
    compute_all(bm, new)
    bm.free(new)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # Plain free blocks go first; then the least recently freed cached block ("old").
    x = make_request("x", range(200, 208))
    assert bm.allocate(x, [], 8) is not None
    assert bm.num_cached_blocks == 2
    y = make_request("y", range(300, 304))
    assert bm.allocate(y, [], 4) is not None
    assert bm.num_cached_blocks == 1
    assert bm.get_computed_blocks(make_request("old2", range(0, 5))) == [[]]
    assert len(bm.get_computed_blocks(make_request("new2", range(100, 105)))[0]) == 1
    assert bm.audit() == []


def test_hit_on_evictable_block_takes_it_out_of_the_free_pool():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request("a", range(9))
    compute_all(bm, a)
    bm.free(a)
    b = make_request("b", range(9))
    hits = bm.get_computed_blocks(b)
    assert len(hits[0]) == 2
    # b needs 3 blocks: 2 hits + 1 new; the pool (all 3 allocatable) covers it.
    assert bm.can_allocate(b, 9, hits)
    assert bm.allocate(b, hits, 9) is not None
    assert bm.num_free_blocks == 0 and bm.audit() == []


def test_same_prefix_computed_twice_is_registered_once():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", range(6)), make_request("b", range(6))
    bm.allocate(a, [], 6)
    bm.allocate(b, [], 6)
    bm.cache_blocks(a, 6)
    bm.cache_blocks(b, 6)
    assert bm.num_cached_blocks == 1 and bm.audit() == []
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.audit() == []


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    compute_all(bm, make_request("a", range(9)))
    assert bm.get_computed_blocks(make_request("b", range(9))) == [[]]
    assert bm.num_cached_blocks == 0 and bm.num_prefix_queries == 0


def test_audit_reports_discrepancies():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", range(6))
    bm.allocate(a, [], 6)
    bm.ref_counts[bm.block_table("a")[0]] += 1
    assert any("ref count 2 but 1 holders" in issue for issue in bm.audit())
    bm.ref_counts[bm.block_table("a")[0]] -= 1
    bm._free.pop()  # a lost block
    assert any("!= total" in issue for issue in bm.audit())


def test_invalid_pool_is_rejected():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=BS)


def run_in_chunks(bm, request, chunk):
    """Compute the request chunk by chunk as the scheduler would; returns the most blocks its
    sliding group (group 1) held at once."""
    bm.allocate(request, bm.get_computed_blocks(request), min(chunk, request.num_tokens))
    request.num_computed_tokens = 0
    most = 0
    while request.num_computed_tokens < request.num_tokens:
        end = min(request.num_computed_tokens + chunk, request.num_tokens)
        tables = bm.append_slots(request, end)
        assert tables is not None and bm.audit() == []
        most = max(most, sum(b != bm.null_block for b in tables[1]))
        request.num_computed_tokens = end
        bm.cache_blocks(request, end)
    return most


def test_a_sliding_group_holds_its_window_not_the_context():
    bm = BlockManager(num_blocks=40, block_size=BS, windows=(None, 8))
    request = make_request("a", range(60))
    most = run_in_chunks(bm, request, chunk=4)
    full, sliding = bm.block_tables("a")
    assert len(full) == len(sliding) == 15 and bm.null_block not in full
    # The next query (position 60) sees 53..60: blocks 13 and 14 (and 12 until the release).
    assert most <= -(-(8 - 1 + 4) // BS) + 1
    assert sliding[:12] == [bm.null_block] * 12 and bm.null_block not in sliding[13:]
    bm.release_outside_window(request)
    assert sliding[:13] == [bm.null_block] * 13 and bm.audit() == []
    bm.free(request)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 39 and bm.audit() == []


def test_a_prefix_hit_needs_the_sliding_groups_window_only():
    bm = BlockManager(num_blocks=40, block_size=BS, windows=(None, 6))
    a = make_request("a", range(30))
    run_in_chunks(bm, a, chunk=8)
    bm.free(a)
    b = make_request("b", list(range(30)) + [7])
    full, sliding = bm.get_computed_blocks(b)
    assert len(full) == len(sliding) == 7  # 28 tokens: the next query (28) sees 23..28
    assert sliding[:5] == [bm.null_block] * 5 and bm.null_block not in sliding[5:]
    assert bm.allocate(b, [full, sliding], 31) is not None and bm.audit() == []
    bm.free(b)
    # Without the sliding blocks of the window before position 28, the hit stops where a window is whole.
    for h in b.block_hashes[5:7]:  # evict the sliding group's blocks 5 and 6
        block = bm._cached.pop((1, h))
        bm.block_hashes[block] = None
        del bm._evictable[block]
        bm._free.append(block)
    hits = bm.get_computed_blocks(make_request("c", list(range(30)) + [7]))
    assert len(hits[0]) == 5 and bm.audit() == []


def test_windows_are_checked():
    with pytest.raises(ValueError, match="window"):
        BlockManager(num_blocks=8, block_size=BS, windows=(None, 0))
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(num_blocks=1, block_size=BS, windows=(4,))
