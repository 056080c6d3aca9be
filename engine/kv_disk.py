"""The prefix cache's disk tier: full KV blocks that leave memory are kept in files, and a prefix
hit that misses memory reads them back instead of computing them again, across restarts too.

    evicted / shutdown  engine thread: one copy of the block's bytes -> bounded queue
                        writer thread: tmp file, fsync-free write, rename   (no request waits)
    prefix hit          engine thread, at admission: read, check, copy into a fresh block

A block is named by its group, its chained hash (engine/block_manager.py: the request's
cache_salt and LoRA adapter are in the chain) and the model's fingerprint (weights, dtypes, KV
layout, block size), so files of another model, or of another tenant's salt, never match. A file:

    header   magic "PSKV", format version, fingerprint (16 bytes), group, block hash (16 bytes),
             payload length
    payload  the block's bytes in every cache tensor, tensor after tensor, as the cache holds them
             (GQA, MLA latents, int8 rows with their scales alike)
    crc32    of header and payload

A torn, truncated, foreign or old-version file fails the check when read: it is counted, removed
and never served (the block is computed instead). The directory is bounded by size, least
recently used first (the index is rebuilt from the directory at start, by modification time,
which a read refreshes). A write that fails (disk full, read-only) turns the tier off with one
warning; serving goes on from memory. One process holds the directory at a time (flock on
DIR/lock); a second refuses it at start.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from models.layers.attention import KVCacheLayout, KVCacheSpec
    from models.loader import LoadedModel

logger = logging.getLogger(__name__)

MAGIC = b"PSKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sI16sI16sQ")  # magic, version, fingerprint, group, block hash, payload length
_CRC = struct.Struct("<I")
SUFFIX = ".kvb"
WRITE_QUEUE_BYTES = 256 * 2**20  # copies waiting for the writer at most; more are dropped


class DiskTierLockedError(ValueError):
    """Another process holds the directory."""


@dataclass(frozen=True)
class DiskTierStats:
    enabled: bool = False
    directory: str = ""
    max_bytes: int = 0
    num_bytes: int = 0  # files on disk now
    num_files: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    num_files_rejected: int = 0  # torn, truncated, foreign or old-version files removed
    num_writes_dropped: int = 0  # blocks not written: the queue was full, or the tier is off


def model_fingerprint(loaded: LoadedModel, spec: KVCacheSpec, layout: KVCacheLayout, block_size: int) -> bytes:
    """16 bytes naming what a block's bytes depend on: the model's configuration, its weights (the
    names, shapes and dtypes of every tensor, and the first and last bytes of each), the KV
    cache's dtype, entry shape, layout and block size (and an int8 cache's key offsets and scales)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"pagedserve-kv-disk {FORMAT_VERSION}".encode())
    config = loaded.config
    for f in fields(config):
        text = repr(getattr(config, f.name))
        if " at 0x" not in text:  # an object's address differs from run to run
            h.update(f"{f.name}={text};".encode())
    h.update(repr((spec.entry_shape, spec.stored_shape, str(spec.dtype), layout, block_size)).encode())
    for name, tensor in loaded.model.state_dict().items():
        h.update(f"{name}{tuple(tensor.shape)}{tensor.dtype};".encode())
        try:
            flat = tensor.detach().reshape(-1)
            ends = torch.cat([flat[:256], flat[-256:]]).cpu().contiguous()
            h.update(ends.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # a tensor type with no plain bytes: its shape stands in
            pass
    if spec.dtype == torch.int8:  # its keys are stored with these (models/kv_int8.py)
        for module in loaded.model.modules():
            for name in ("key_offset", "key_scale"):
                found = getattr(module, name, None)
                if isinstance(found, torch.Tensor):
                    h.update(found.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def file_name(fingerprint: bytes, group: int, block_hash: int) -> str:
    return f"{fingerprint.hex()[:16]}-{group}-{block_hash:032x}{SUFFIX}"


def encode(fingerprint: bytes, group: int, block_hash: int, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """A file's parts: header, payload, checksum."""
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, fingerprint, group, block_hash.to_bytes(16, "little"), len(payload))
    return [header, payload, _CRC.pack(zlib.crc32(payload, zlib.crc32(header)))]


def decode(data: bytes | bytearray, fingerprint: bytes, group: int, block_hash: int, length: int) -> memoryview | None:
    """The payload of a file's bytes, or None if they are not a sound file of this block."""
    if len(data) != _HEADER.size + length + _CRC.size:
        return None
    view = memoryview(data)
    magic, version, fp, g, h, n = _HEADER.unpack_from(view)
    if (magic, version, fp, g, h, n) != (
        MAGIC,
        FORMAT_VERSION,
        fingerprint,
        group,
        block_hash.to_bytes(16, "little"),
        length,
    ):
        return None
    end = _HEADER.size + length
    if _CRC.unpack_from(view, end)[0] != zlib.crc32(view[_HEADER.size : end], zlib.crc32(view[: _HEADER.size])):
        return None
    return view[_HEADER.size : end]


class DiskStore:
    """Files of blocks of one model in one directory, bounded by size. Engine thread: `contains`,
    `put`, `get`, `close`; the writer thread writes and evicts."""

    def __init__(self, directory: str, max_bytes: int, fingerprint: bytes, payload_bytes: int):
        self.directory = os.path.abspath(directory)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.file_bytes = _HEADER.size + payload_bytes + _CRC.size
        self.enabled = True
        self._lock = threading.Lock()  # the index and the counters
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self._pending: dict[str, torch.Tensor] = {}  # queued, not yet written
        self._bytes = 0
        self.bytes_read = self.bytes_written = 0
        self.read_seconds = self.write_seconds = 0.0
        self.num_files_rejected = self.num_writes_dropped = 0
        self._lock_file: int | None = None
        self._queue: queue.Queue = queue.Queue(max(1, WRITE_QUEUE_BYTES // self.file_bytes))
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(os.path.join(self.directory, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            self._turn_off(f"cannot use {self.directory}: {exc}")
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskTierLockedError(
                f"--kv-cache-disk {self.directory} is in use by another server (its lock file is held); "
                "give each server its own directory"
            ) from None
        self._lock_file = fd
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="pagedserve-kv-disk", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        """The index from the directory: every block file, oldest first; leftovers of torn writes removed."""
        entries = []
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name.endswith(".tmp"):
                    _unlink(e.path)
                elif e.name.endswith(SUFFIX) and e.is_file():
                    st = e.stat()
                    entries.append((st.st_mtime_ns, e.name, st.st_size))
        for _, name, size in sorted(entries):
            self._index[name] = size
            self._bytes += size
        self._evict_over_bound()

    def _turn_off(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            logger.warning("KV cache disk tier off, serving from memory only: %s", why)

    # ------------------------------------------------------------ engine thread
    def contains(self, group: int, block_hash: int) -> bool:
        name = file_name(self.fingerprint, group, block_hash)
        return self.enabled and (name in self._index or name in self._pending)

    def put(self, group: int, block_hash: int, payload: torch.Tensor, wait: bool = False) -> None:
        """Queue a block's bytes (a uint8 CPU tensor of payload_bytes) to be written; dropped if the
        queue is full, unless `wait` (shutdown)."""
        name = file_name(self.fingerprint, group, block_hash)
        if not self.enabled or name in self._index or name in self._pending:
            return
        with self._lock:
            self._pending[name] = payload
        try:
            self._queue.put((name, group, block_hash, payload), block=wait)
        except queue.Full:
            with self._lock:
                self._pending.pop(name, None)
                self.num_writes_dropped += 1

    def get(self, group: int, block_hash: int) -> memoryview | torch.Tensor | None:
        """The block's bytes, checked; None if it is not here or its file is unsound (then removed)."""
        name = file_name(self.fingerprint, group, block_hash)
        if not self.enabled:
            return None
        pending = self._pending.get(name)
        if pending is not None:
            return pending
        if name not in self._index:
            return None
        start = time.perf_counter()
        path = os.path.join(self.directory, name)
        data = bytearray(self.file_bytes)  # writable: the cache copies from it with no warning
        try:
            with open(path, "rb") as f:
                size = f.readinto(data)
                if f.read(1):
                    size += 1
        except OSError:  # evicted by the writer meanwhile, or unreadable
            with self._lock:
                self._forget(name)
            return None
        payload = None if size != len(data) else decode(data, self.fingerprint, group, block_hash, self.payload_bytes)
        with self._lock:
            self.read_seconds += time.perf_counter() - start
            if payload is None:
                self.num_files_rejected += 1
                self._forget(name)
            else:
                self.bytes_read += size
                if name in self._index:
                    self._index.move_to_end(name)
        if payload is None:
            logger.warning("KV cache disk tier: %s is torn, truncated or not this model's; removed", name)
            _unlink(path)
            return None
        try:
            os.utime(path)  # the least recently used go first, after a restart too
        except OSError:
            pass
        return payload

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                enabled=self.enabled,
                directory=self.directory,
                max_bytes=self.max_bytes,
                num_bytes=self._bytes,
                num_files=len(self._index),
                bytes_read=self.bytes_read,
                bytes_written=self.bytes_written,
                read_seconds=self.read_seconds,
                write_seconds=self.write_seconds,
                num_files_rejected=self.num_files_rejected,
                num_writes_dropped=self.num_writes_dropped,
            )

    def close(self) -> None:
        """Write what is queued, stop the writer, let the directory go."""
        if self._lock_file is None:
            return
        self._queue.put(None)
        self._writer.join()
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        os.close(self._lock_file)
        self._lock_file = None

    # ------------------------------------------------------------ writer thread
    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            name, group, block_hash, payload = item
            if self.enabled:
                self._write(name, group, block_hash, payload)
            with self._lock:
                self._pending.pop(name, None)

    def _write(self, name: str, group: int, block_hash: int, payload: torch.Tensor) -> None:
        start = time.perf_counter()
        path = os.path.join(self.directory, name)
        tmp = f"{path}.{os.getpid()}.tmp"
        parts = encode(self.fingerprint, group, block_hash, payload.numpy().data)
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)  # a reader sees the whole file or none
        except OSError as exc:
            _unlink(tmp)
            self._turn_off(f"writing {path}: {exc}")
            return
        size = self.file_bytes
        with self._lock:
            self.write_seconds += time.perf_counter() - start
            self.bytes_written += size
            self._forget(name)
            self._index[name] = size
            self._bytes += size
        self._evict_over_bound()

    def _evict_over_bound(self) -> None:
        while True:
            with self._lock:
                if self._bytes <= self.max_bytes or not self._index:
                    return
                name = next(iter(self._index))
                self._forget(name)
            _unlink(os.path.join(self.directory, name))

    def _forget(self, name: str) -> None:
        """Drop a file from the index (the lock held)."""
        size = self._index.pop(name, None)
        if size is not None:
            self._bytes -= size


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def slot_tensors(kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> list[torch.Tensor]:
    """The distinct cache tensors, in slot order (layers of different groups share them)."""
    first_layer = {slot: layer for layer, slot in reversed(list(enumerate(layout.layer_slots)))}
    tensors = [kv_caches[first_layer[slot]] for slot in range(layout.num_slots)]
    assert all(t.is_contiguous() for t in tensors)  # a block's row is one run of bytes
    return tensors


def payload_bytes(kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> int:
    """Bytes of one block id in every cache tensor."""
    return sum(t[0].numel() * t.element_size() for t in slot_tensors(kv_caches, layout))


class KVDiskTier:
    """The block manager's lower tier (block_manager.LowerTier): block ids <-> the cache tensors'
    bytes <-> a DiskStore. One block id is the same bytes in every slot tensor of the layout
    (models/layers/attention.py's KVCacheLayout), so a block's payload is its row in each."""

    def __init__(self, store: DiskStore, kv_caches: list[torch.Tensor], layout: KVCacheLayout):
        self.store = store
        self.tensors = slot_tensors(kv_caches, layout)
        self.block_bytes = [t[0].numel() * t.element_size() for t in self.tensors]

    def contains(self, key: tuple[int, int]) -> bool:
        return self.store.contains(*key)

    def save(self, block_id: int, key: tuple[int, int], wait: bool = False) -> None:
        if not self.store.enabled or self.store.contains(*key):
            return
        # (payload_bytes,) one copy out of the pool: the block is reused as soon as we return
        payload = torch.cat([t[block_id].reshape(-1).view(torch.uint8) for t in self.tensors]).cpu()
        self.store.put(*key, payload, wait=wait)

    def load(self, block_id: int, key: tuple[int, int]) -> bool:
        payload = self.store.get(*key)
        if payload is None:
            return False
        if not isinstance(payload, torch.Tensor):
            payload = torch.frombuffer(payload, dtype=torch.uint8)
        offset = 0
        for tensor, n in zip(self.tensors, self.block_bytes):
            tensor[block_id].reshape(-1).view(torch.uint8).copy_(payload[offset : offset + n])
            offset += n
        return True
