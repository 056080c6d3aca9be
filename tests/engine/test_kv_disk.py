"""The prefix cache's disk tier (engine/kv_disk.py): files that round-trip, are never served torn,
truncated or of another model, stay within their bound; and engines that start warm from it, with
the tokens and logprobs of a cold prefill, for GQA, sliding-window groups and MLA's int8 latents."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_disk import FORMAT_VERSION, DiskStore, DiskTierLockedError, encode, file_name
from engine.llm import LLM
from engine.request import SamplingParams
from models.loader import load_model
from tests.models.conftest import make_hf_model, save_checkpoint

REPO = Path(__file__).resolve().parents[2]
FP, OTHER_FP = b"f" * 16, b"o" * 16
PAYLOAD = 512


def payload(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (PAYLOAD,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def stored(directory, blocks: dict[tuple[int, int], torch.Tensor], fingerprint: bytes = FP) -> None:
    store = DiskStore(str(directory), 2**30, fingerprint, PAYLOAD)
    for key, data in blocks.items():
        store.put(*key, data, wait=True)
    store.close()


# ------------------------------------------------------------------ the store
def test_a_block_round_trips_through_a_restart(tmp_path):
    stored(tmp_path, {(0, 123): payload(1), (1, 123): payload(2)})
    store = DiskStore(str(tmp_path), 2**30, FP, PAYLOAD)
    assert store.contains(0, 123) and store.contains(1, 123) and not store.contains(0, 124)
    assert bytes(store.get(0, 123)) == payload(1).numpy().tobytes()
    assert bytes(store.get(1, 123)) == payload(2).numpy().tobytes()
    s = store.stats()
    assert s.num_files == 2 and s.bytes_read == 2 * store.file_bytes and s.num_files_rejected == 0
    store.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    damage=st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
        st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
        st.tuples(st.just("append"), st.integers(1, 64), st.just(0)),
    )
)
def test_a_damaged_file_is_never_served_and_is_removed(damage):
    kind, where, xor = damage
    with tempfile.TemporaryDirectory() as directory:
        stored(directory, {(0, 7): payload(7)})
        path = os.path.join(directory, file_name(FP, 0, 7))
        data = bytearray(Path(path).read_bytes())
        if kind == "flip":
            data[where % len(data)] ^= xor
        elif kind == "truncate":
            data = data[: where % len(data)]
        else:
            data += bytes(where)
        Path(path).write_bytes(data)
        store = DiskStore(directory, 2**30, FP, PAYLOAD)
        assert store.contains(0, 7)
        assert store.get(0, 7) is None
        assert not os.path.exists(path) and not store.contains(0, 7)
        assert store.stats().num_files_rejected == 1 and store.stats().num_files == 0
        store.close()


def test_a_file_of_another_model_or_format_version_is_rejected(tmp_path):
    # Named as ours, written by another model: its header says so.
    stored(tmp_path, {(0, 5): payload(5)}, fingerprint=OTHER_FP)
    os.rename(tmp_path / file_name(OTHER_FP, 0, 5), tmp_path / file_name(FP, 0, 5))
    # An older format, checksum and all sound.
    header, body, crc = encode(FP, 0, 6, payload(6).numpy().tobytes())
    old = header[:4] + (FORMAT_VERSION - 1).to_bytes(4, "little") + header[8:]
    import zlib

    (tmp_path / file_name(FP, 0, 6)).write_bytes(old + body + zlib.crc32(body, zlib.crc32(old)).to_bytes(4, "little"))
    store = DiskStore(str(tmp_path), 2**30, FP, PAYLOAD)
    assert store.get(0, 5) is None and store.get(0, 6) is None
    assert store.stats().num_files_rejected == 2 and not list(tmp_path.glob("*.kvb"))
    store.close()
    # Another model's own files are not ours to read.
    stored(tmp_path, {(0, 5): payload(5)}, fingerprint=OTHER_FP)
    store = DiskStore(str(tmp_path), 2**30, FP, PAYLOAD)
    assert not store.contains(0, 5) and store.get(0, 5) is None
    store.close()


def test_the_directory_stays_within_its_bound_least_recently_used_first(tmp_path):
    store = DiskStore(str(tmp_path), 2**30, FP, PAYLOAD)
    file_bytes = store.file_bytes
    store.close()
    store = DiskStore(str(tmp_path), 3 * file_bytes, FP, PAYLOAD)
    for h in range(3):
        store.put(0, h, payload(h), wait=True)
    store.close()  # every write done
    store = DiskStore(str(tmp_path), 3 * file_bytes, FP, PAYLOAD)
    assert store.get(0, 0) is not None  # read: the most recently used now
    store.put(0, 3, payload(3), wait=True)
    store.put(0, 4, payload(4), wait=True)
    store.close()
    names = sorted(p.name for p in tmp_path.glob("*.kvb"))
    assert names == sorted(file_name(FP, 0, h) for h in (0, 3, 4))
    assert sum(p.stat().st_size for p in tmp_path.glob("*.kvb")) <= 3 * file_bytes
    # A bound below one file keeps none: every write is evicted at once, nothing fails.
    store = DiskStore(str(tmp_path), 1, FP, PAYLOAD)
    store.put(0, 9, payload(9), wait=True)
    store.close()
    assert not list(tmp_path.glob("*.kvb"))


def test_a_full_disk_turns_the_tier_off_with_one_warning(tmp_path):
    # A file-size limit (RLIMIT_FSIZE) below one block file: every write fails with EFBIG, as on a full disk.
    script = f"""
import logging, resource, signal, sys, torch
sys.path.insert(0, {str(REPO)!r})
from engine.kv_disk import DiskStore
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.RLIM_INFINITY))
store = DiskStore({str(tmp_path)!r}, 2**30, b"f" * 16, 512)
for h in range(5):
    store.put(0, h, torch.zeros(512, dtype=torch.uint8), wait=True)
store.close()
print("enabled", store.enabled, "files", store.stats().num_files, "found", store.contains(0, 1), store.get(0, 1))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "enabled False files 0 found False None" in out.stdout
    assert out.stderr.count("KV cache disk tier off") == 1, out.stderr
    assert not list(tmp_path.glob("*.kvb")) and not list(tmp_path.glob("*.tmp"))


def test_a_second_store_on_one_directory_is_refused(tmp_path):
    first = DiskStore(str(tmp_path), 2**30, FP, PAYLOAD)
    with pytest.raises(DiskTierLockedError, match="in use by another server"):
        DiskStore(str(tmp_path), 2**30, FP, PAYLOAD)
    first.close()
    DiskStore(str(tmp_path), 2**30, FP, PAYLOAD).close()  # free again once the first let go


# ------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The engine tests' tiny Llama with room for 4096 positions."""
    hf_model = make_hf_model("llama", seed=1, max_position_embeddings=4096)
    return load_model(str(save_checkpoint(hf_model, tmp_path_factory.mktemp("long-llama"))), dtype="float32")


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(loaded, prompts, params=GREEDY, **config):
    """Results of one engine's life (its blocks written to the disk tier, if any, when it closes)."""
    llm = LLM.from_loaded(loaded, block_size=16, **config)
    try:
        results = llm.generate(prompts, params)
        return results, llm.engine.stats()
    finally:
        llm.close()


def same_output(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert [t.logprob for t in a.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-4)


def test_a_restarted_engine_serves_a_long_prefix_from_disk_as_a_cold_prefill_would(long_llama, tmp_path):
    long = prompt(2000)
    [cold], _ = serve(long_llama, [long], num_kv_blocks=160)
    [first], stats_a = serve(long_llama, [long], num_kv_blocks=160, kv_cache_disk=str(tmp_path))
    assert stats_a.prefix_cache_disk_hits == 0
    assert len(list(tmp_path.glob("*.kvb"))) == (2000 + 5) // 16  # every full block, at shutdown
    [warm], stats_b = serve(long_llama, [long], num_kv_blocks=160, kv_cache_disk=str(tmp_path))
    same_output(first, cold)
    same_output(warm, cold)
    assert warm.num_cached_tokens == stats_b.prefix_cache_disk_hits == 1999 // 16 * 16
    assert stats_b.num_computed_tokens == 2000 - 1999 // 16 * 16 + 5  # the prefill of those blocks skipped
    assert stats_b.kv_disk.bytes_read > 0 and stats_b.kv_disk.num_files_rejected == 0


def test_blocks_evicted_under_load_come_back_from_disk(long_llama, tmp_path):
    # A pool of 30 blocks: the second prompt evicts the first one's (its last blocks first), which
    # go to disk on the way out.
    a, b = prompt(300, seed=1), prompt(300, seed=2)
    llm = LLM.from_loaded(long_llama, block_size=16, num_kv_blocks=30, kv_cache_disk=str(tmp_path))
    try:
        [cold_a] = llm.generate([a], GREEDY)
        llm.generate([b], GREEDY)
        [again_a] = llm.generate([a], GREEDY)
        stats = llm.engine.stats()
    finally:
        llm.close()
    same_output(again_a, cold_a)
    assert again_a.num_cached_tokens == 299 // 16 * 16  # memory and disk together
    assert 0 < stats.prefix_cache_disk_hits < again_a.num_cached_tokens
    assert stats.kv_disk.bytes_written > 0
    assert llm.engine.audit() == []


def test_salted_prefixes_do_not_cross_through_the_disk(long_llama, tmp_path):
    long = prompt(500, seed=3)

    def salted(salt):
        return SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, cache_salt=salt)

    serve(long_llama, [long], salted("tenant-a"), num_kv_blocks=64, kv_cache_disk=str(tmp_path))
    [_], other = serve(long_llama, [long], salted("tenant-b"), num_kv_blocks=64, kv_cache_disk=str(tmp_path))
    [_], unsalted = serve(long_llama, [long], salted(None), num_kv_blocks=64, kv_cache_disk=str(tmp_path))
    [_], same = serve(long_llama, [long], salted("tenant-a"), num_kv_blocks=64, kv_cache_disk=str(tmp_path))
    assert other.prefix_cache_disk_hits == 0 and unsalted.prefix_cache_disk_hits == 0
    assert same.prefix_cache_disk_hits == 499 // 16 * 16


def test_a_foreign_model_starts_cold_from_the_same_directory(long_llama, tmp_path):
    long = prompt(300, seed=4)
    serve(long_llama, [long], num_kv_blocks=64, kv_cache_disk=str(tmp_path))
    other = load_model(
        str(save_checkpoint(make_hf_model("llama", seed=2, max_position_embeddings=4096), tmp_path / "other")),
        dtype="float32",
    )
    [_], stats = serve(other, [long], num_kv_blocks=64, kv_cache_disk=str(tmp_path))
    assert stats.prefix_cache_disk_hits == 0
    # KV dtype is part of the fingerprint too.
    [_], stats = serve(long_llama, [long], num_kv_blocks=64, kv_cache_disk=str(tmp_path), kv_cache_dtype="bfloat16")
    assert stats.prefix_cache_disk_hits == 0


def test_an_unusable_directory_leaves_serving_to_memory(long_llama, tmp_path, caplog):
    (tmp_path / "a-file").write_text("not a directory")
    long = prompt(100, seed=5)
    [cold], _ = serve(long_llama, [long], num_kv_blocks=64)
    with caplog.at_level(logging.WARNING, logger="engine.kv_disk"):
        [out], stats = serve(long_llama, [long], num_kv_blocks=64, kv_cache_disk=str(tmp_path / "a-file" / "kv"))
    same_output(out, cold)
    assert stats.kv_disk.enabled is False
    assert len([r for r in caplog.records if "disk tier off" in r.message]) == 1


def test_two_engines_on_one_directory_the_second_is_refused(long_llama, tmp_path):
    first = EngineCore(long_llama, EngineConfig(num_kv_blocks=16, kv_cache_disk=str(tmp_path)))
    try:
        with pytest.raises(DiskTierLockedError):
            EngineCore(long_llama, EngineConfig(num_kv_blocks=16, kv_cache_disk=str(tmp_path)))
    finally:
        first.close()


def test_sliding_window_groups_start_warm(tmp_path):
    """Gemma 2 (sliding and global layers: two KV cache groups), a prompt of many windows."""
    from tests.models.test_gemma import CASES

    arch, overrides = CASES["gemma2"]
    hf_model = make_hf_model(arch, **{**overrides, "max_position_embeddings": 1024})
    loaded = load_model(str(save_checkpoint(hf_model, tmp_path / "gemma2")), dtype="float32")
    long = prompt(200, seed=6)
    [cold], _ = serve(loaded, [long], num_kv_blocks=64)
    serve(loaded, [long], num_kv_blocks=64, kv_cache_disk=str(tmp_path / "kv"))
    [warm], stats = serve(loaded, [long], num_kv_blocks=64, kv_cache_disk=str(tmp_path / "kv"))
    same_output(warm, cold)
    assert stats.prefix_cache_disk_hits == 199 // 16 * 16


def test_mla_int8_latents_start_warm(tmp_path):
    """DeepSeek's latent cache in int8 (rows with their scales): its raw bytes round-trip."""
    from tests.models.test_deepseek import make_hf_deepseek

    hf = make_hf_deepseek("v3-q-lora", max_position_embeddings=1024)
    loaded = load_model(str(save_checkpoint(hf, tmp_path / "mla")), dtype="float32")
    long = torch.randint(0, hf.config.vocab_size, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    config = dict(num_kv_blocks=64, kv_cache_dtype="int8")
    [cold], _ = serve(loaded, [long], **config)
    serve(loaded, [long], kv_cache_disk=str(tmp_path / "kv"), **config)
    [warm], stats = serve(loaded, [long], kv_cache_disk=str(tmp_path / "kv"), **config)
    same_output(warm, cold)
    assert stats.prefix_cache_disk_hits == 149 // 16 * 16


# ------------------------------------------------------- the block manager's side
class DictTier:
    """A lower tier in a dict; a block read back records the key whose bytes it would hold."""

    def __init__(self):
        self.saved: dict[tuple[int, int], int] = {}
        self.contents: dict[int, tuple[int, int]] = {}  # block id -> the key whose bytes it holds

    def contains(self, key):
        return key in self.saved

    def save(self, block_id, key, wait=False):
        self.saved[key] = block_id

    def load(self, block_id, key):
        self.contents[block_id] = key
        return key in self.saved


def test_evicted_blocks_go_down_and_come_back_as_hits():
    from engine.block_manager import BlockManager
    from engine.request import Request

    tier = DictTier()
    bm = BlockManager(num_blocks=6, block_size=4, lower_tier=tier)
    a = Request("a", list(range(17)), SamplingParams(max_tokens=1))
    tables = bm.allocate(a, bm.get_computed_blocks(a), 17)
    bm.cache_blocks(a, 17)
    bm.free(a)
    assert tables is not None and not tier.saved
    b = Request("b", list(range(100, 124)), SamplingParams(max_tokens=1))  # takes every block: a's evicted
    assert bm.allocate(b, bm.get_computed_blocks(b), 24) is not None
    assert len(tier.saved) == 4  # a's four full blocks, saved as they were evicted
    bm.free(b)
    again = Request("a2", list(range(17)), SamplingParams(max_tokens=1))
    hits = bm.get_computed_blocks(again)
    assert len(hits[0]) == 4 and all(tier.contents[block] == (0, h) for block, h in zip(hits[0], again.block_hashes))
    assert bm.allocate(again, hits, 17) is not None and bm.audit() == []
    assert bm.num_prefix_lower_tier_hits == 16


def test_lora_blocks_never_leave_memory():
    from engine.block_manager import BlockManager
    from engine.request import Request

    tier = DictTier()
    bm = BlockManager(num_blocks=6, block_size=4, lower_tier=tier)
    a = Request("a", list(range(17)), SamplingParams(max_tokens=1), lora_cache_key="adapter#1")
    bm.allocate(a, bm.get_computed_blocks(a), 17)
    bm.cache_blocks(a, 17)
    bm.free(a)
    b = Request("b", list(range(100, 124)), SamplingParams(max_tokens=1))
    bm.allocate(b, bm.get_computed_blocks(b), 24)
    bm.save_cached()
    assert not tier.saved


def test_no_read_back_when_the_pool_has_no_room():
    from engine.block_manager import BlockManager
    from engine.request import Request

    tier = DictTier()
    bm = BlockManager(num_blocks=4, block_size=4, lower_tier=tier)
    holder = Request("h", list(range(200, 212)), SamplingParams(max_tokens=1))
    bm.allocate(holder, [], 12)  # three of four blocks held
    a = Request("a", list(range(17)), SamplingParams(max_tokens=1))
    bm._hash_blocks(a)
    tier.saved = {(0, h): 0 for h in a.block_hashes}
    assert bm.get_computed_blocks(a) == [[]] and not tier.contents and bm.audit() == []
