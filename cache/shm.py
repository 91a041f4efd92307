"""Machine-wide shared-memory embedding cache: one arena per name, shared by every encoder worker process.

Mechanism
- Arena: a plain file `/dev/shm/<name>` (tmpfs, so RAM), mapped with `mmap` by every process that attaches.
  It is not a `multiprocessing.shared_memory` segment, so no resource tracker unlinks it when its creator
  exits: it lives until `unlink()` (or a reboot), and a restarted fleet attaches to it warm. Creation
  reserves the RAM with `posix_fallocate`, so a /dev/shm too small (a container's 64 MB default) fails at
  creation rather than with SIGBUS on a later write. Byte layout: `cache.shm_layout`; index, LRU list,
  allocator and crash repair: `cache.shm_arena`.
- Capacity: `capacity_bytes` is the data region (rounded down to 64); each entry takes a 192-byte header
  plus its payload rounded up to 64 (`cache.shm_layout.block_bytes`); `bytes_used` counts the same. The
  hash table (8 bytes per 2 KiB of capacity by default) comes on top. Attaching to an existing arena keeps
  the creator's capacity and ignores the `capacity_bytes` passed.
- Allocator and eviction: variable-size blocks with free lists per power-of-two size class (good fit,
  split, merge with free neighbours). Eviction is LRU over whole entries: the least recently used entry
  goes, merged with its free neighbours, until the new entry fits (fragmentation can make that more than
  the bare byte count would need).
- Lock: one machine-wide lock, `flock` on the arena file, which the kernel drops when its holder dies.
  flock belongs to an open file description, so each instance opens its own fd (a forked child reopens
  it), and a `threading.Lock` orders the threads of one process. A wait past `lock_timeout_s` gives up:
  `put` returns False, `get` returns None (counted as a put failure / miss, and a lock timeout).
- put: under the lock, drop the key's old entry, evict until a block fits, reserve it (PENDING), write
  header + key + payload, publish it (VALID, in the table, at the LRU head). Writers copy under the lock
  (1 MB holds it ~0.1 ms).
- get: look the key up under the lock and note the block's offset and generation, copy the payload out
  *outside* the lock (readers do not serialise on copies), then re-check under the lock that the key still
  maps to that block with that generation, and only then return the copy (else go again, up to 4 times,
  then report a miss). A block is only rewritten after it was freed, which drops it from the table, so a
  passed re-check proves no writer touched the bytes during the copy. Lookups also compare the key stored
  in the block header with the key asked for.
- Crash recovery: a lock holder SIGKILLed mid-mutation leaves the arena's dirty word set, and the next lock
  holder rebuilds the index from the block chain; one killed while copying a payload leaves its block
  PENDING, and the next holder frees it. A killed reader holds nothing.

`get` returns a private copy (one copy out of the arena, never a view of shared memory): it stays valid
and unchanged after the entry is overwritten or evicted, or the cache is closed. The first touch of each
arena page costs a process a page fault; after that a get costs ~15 us plus the copy.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import struct
from collections import deque
from pathlib import Path
from typing import Any

import torch

from cache.shm_arena import Arena
from cache.shm_layout import (
    A_BYTES_USED,
    A_CAPACITY,
    A_DIRTY,
    A_ENTRIES,
    A_HITS,
    A_LOCK_TIMEOUTS,
    A_MAX_ENTRIES,
    A_MISSES,
    A_PENDING_OFF,
    A_PUT_FAILURES,
    A_READ_RETRIES,
    ARENA_MAGIC,
    B_GEN,
    B_META,
    B_NBYTES,
    B_PID,
    B_SHAPE,
    BLOCK_HEADER_BYTES,
    COUNTERS,
    KEY_OFFSET,
    MAX_KEY_BYTES,
    MAX_NDIM,
    ArenaLayout,
    block_bytes,
    key_hash,
)
from cache.shm_lock import ArenaLock, flock_within

SHM_DIR = Path("/dev/shm")
DEFAULT_LOCK_TIMEOUT_S = 0.5
ATTACH_TIMEOUT_S = 60.0  # creating an arena fallocates all of it, which takes a while for many GB
_MAX_READ_ATTEMPTS = 4  # a get whose copy raced an eviction or rewrite of its key retries this often
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")

# NOTE: the codes are part of the arena format: append only, never reorder.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES, start=1)}


class ShmEmbeddingCache:
    """A machine-wide LRU cache of tensors keyed by short strings, in one shared-memory arena.

    Args:
        name: arena name, a file name under /dev/shm (letters, digits, `._-`).
        capacity_bytes: data region size when this call creates the arena; ignored when attaching
            (the creator's capacity wins).
        create: True creates the arena when missing, else attaches to it; False only attaches and raises
            FileNotFoundError when there is no initialised arena of that name.
        max_entries: most entries at once when creating (default: one per 4 KiB of capacity, 256..4M).
        lock_timeout_s: how long get/put/contains wait for the machine-wide lock before giving up.

    Raises:
        FileNotFoundError: create=False and no initialised arena of that name.
        FileExistsError: the file of that name is not an arena of this format (unlink it).
        OSError: others from the file system, e.g. ENOSPC when /dev/shm cannot hold the capacity.
        ValueError: a bad name, or (creating) a capacity below one entry.
    """

    def __init__(self, name: str, capacity_bytes: int, create: bool = True, *, max_entries: int | None = None,
                 lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> None:
        self.name, self.path = name, _arena_path(name)
        self.lock_timeout_s = lock_timeout_s
        layout = ArenaLayout.for_capacity(capacity_bytes, max_entries) if create else None
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
        try:
            self._mm = self._attach(fd, layout)
        except BaseException:
            os.close(fd)
            raise
        self._arena_lock = ArenaLock(fd)
        self._arena: Arena | None = Arena(self._mm)
        self._unflushed: deque[int] = deque()  # counter words of events seen without the lock (append is atomic)

    def _attach(self, fd: int, layout: ArenaLayout | None) -> mmap.mmap:
        """Map the arena, first initialising it under the lock when it is new or its creator died mid-way."""
        if not flock_within(fd, ATTACH_TIMEOUT_S):
            raise TimeoutError(f"shared-memory cache {self.name!r} stayed locked for {ATTACH_TIMEOUT_S}s")
        try:
            magic, file_bytes = struct.unpack("<2q", os.pread(fd, 16, 0).ljust(16, b"\0"))
            if magic == ARENA_MAGIC:
                if os.fstat(fd).st_size != file_bytes:
                    raise FileExistsError(f"{self.path}: arena file is {os.fstat(fd).st_size} bytes, header says "
                                          f"{file_bytes}; unlink it")
                return mmap.mmap(fd, file_bytes)
            if magic != 0:
                raise FileExistsError(f"{self.path} is not an mmenc cache arena of this version; unlink it")
            if layout is None:
                raise FileNotFoundError(f"no initialised shared-memory cache named {self.name!r}")
            os.ftruncate(fd, 0)  # zero whatever a creator that died mid-way left behind
            os.ftruncate(fd, layout.file_bytes)
            try:
                os.posix_fallocate(fd, 0, layout.file_bytes)  # NOTE: reserve the RAM now (no SIGBUS later)
            except OSError:
                os.ftruncate(fd, 0)
                raise
            mm = mmap.mmap(fd, layout.file_bytes)
            arena = Arena(mm)
            arena.format(layout)
            arena.release()
            return mm
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------------------------------------- public API
    def get(self, key: str) -> torch.Tensor | None:
        """The tensor last put under `key` (same dtype and shape) as a private copy, or None on a miss.

        The copy is the only one made (arena -> new tensor) and never aliases shared memory.
        """
        kb = _key_bytes(key)
        h = key_hash(kb)
        arena = self._live()
        w = arena.w
        for _ in range(_MAX_READ_ATTEMPTS):
            if not self._lock():
                break
            try:
                off = arena.find(kb, h)
                if not off:
                    w[A_MISSES] += 1
                    return None
                b = off >> 3
                gen, nbytes, meta = w[b + B_GEN], w[b + B_NBYTES], w[b + B_META]
                shape = [w[b + B_SHAPE + i] for i in range((meta >> 8) & 0xFF)]
            finally:
                self._unlock()
            out = torch.empty(nbytes, dtype=torch.uint8)  # [nbytes]
            start = off + BLOCK_HEADER_BYTES
            out.numpy()[:] = arena.u8[start:start + nbytes]  # NOTE: may race a writer; validated below
            if not self._lock():
                break
            try:
                is_intact = arena.find(kb, h) == off and w[b + B_GEN] == gen
                if is_intact:
                    arena.touch(off)
                    w[A_HITS] += 1
                else:
                    w[A_READ_RETRIES] += 1
            finally:
                self._unlock()
            if is_intact:
                return out.view(_DTYPES[(meta & 0xFF) - 1]).view(shape)
        self._count(A_MISSES)
        return None

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Store a copy of `tensor` under `key`, evicting least-recently-used entries to make room.

        Returns:
            True when stored; False when it cannot fit (bigger than the capacity) or the arena stayed busy
            past `lock_timeout_s`.
        """
        kb = _key_bytes(key)
        h = key_hash(kb)
        arena = self._live()
        code = _DTYPE_CODE.get(tensor.dtype)
        if code is None:
            raise TypeError(f"unsupported dtype {tensor.dtype}; supported: {', '.join(map(str, _DTYPES))}")
        if tensor.dim() > MAX_NDIM:
            raise ValueError(f"at most {MAX_NDIM} dimensions, got shape {tuple(tensor.shape)}")
        payload = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()  # [nbytes]
        need = block_bytes(payload.nbytes)
        if need > arena.capacity or not self._lock():
            self._count(A_PUT_FAILURES)
            return False
        w = arena.w
        try:
            off = arena.reserve(kb, h, need)
            if not off:
                w[A_PUT_FAILURES] += 1
                return False
            b = off >> 3
            try:
                w[b + B_NBYTES], w[b + B_PID] = payload.nbytes, os.getpid()
                w[b + B_META] = code | tensor.dim() << 8 | len(kb) << 16
                for i, n in enumerate(tensor.shape):
                    w[b + B_SHAPE + i] = n
                arena.mv[off + KEY_OFFSET:off + KEY_OFFSET + len(kb)] = kb
                arena.u8[off + BLOCK_HEADER_BYTES:off + BLOCK_HEADER_BYTES + payload.nbytes] = payload
            except BaseException:
                arena.abandon(off)
                raise
            arena.publish(off, h)
            return True
        finally:
            self._unlock()

    def contains(self, key: str) -> bool:
        """Whether `key` has an entry (no effect on LRU order or hit/miss counters)."""
        kb = _key_bytes(key)
        arena = self._live()
        if not self._lock():
            return False
        try:
            return arena.find(kb, key_hash(kb)) != 0
        finally:
            self._unlock()

    def stats(self) -> dict[str, int]:
        """Machine-wide counters kept in the arena: hits, misses, evictions, bytes_used, entries, capacity_bytes,
        puts, put_failures; also max_entries, recoveries (repairs after a dead lock holder), lock_timeouts,
        read_retries (gets whose copy raced an eviction or rewrite of the same block and went again)."""
        arena = self._live()
        is_locked = self._lock()  # best effort: a busy arena still answers, from a lock-free read
        try:
            w = arena.w
            out = {"capacity_bytes": w[A_CAPACITY], "bytes_used": w[A_BYTES_USED], "entries": w[A_ENTRIES],
                   "max_entries": w[A_MAX_ENTRIES]}
            out.update({name: w[word] for name, word in COUNTERS.items()})
            return out
        finally:
            if is_locked:
                self._unlock()

    def clear(self) -> None:
        """Drop all entries (counters are kept)."""
        arena = self._live()
        if not self._lock(ATTACH_TIMEOUT_S):
            raise TimeoutError(f"shared-memory cache {self.name!r} stayed locked for {ATTACH_TIMEOUT_S}s")
        try:
            arena.clear()
        finally:
            self._unlock()

    def close(self) -> None:
        """Detach this process (idempotent). Tensors returned by `get` stay valid."""
        if self._arena is None:
            return
        self._arena.release()
        self._arena = None
        try:
            self._mm.close()
        except BufferError:  # a view of the mapping is still referenced somewhere: unmapped when it goes
            pass
        self._arena_lock.close()

    def unlink(self) -> None:
        """Remove the arena from the machine. Processes still attached keep their mapping until they close."""
        self.path.unlink(missing_ok=True)

    @staticmethod
    def exists(name: str) -> bool:
        """Whether an initialised arena named `name` (that this process may read) is on this machine."""
        try:
            with open(_arena_path(name), "rb") as f:
                return struct.unpack("<q", f.read(8).ljust(8, b"\0"))[0] == ARENA_MAGIC
        except OSError:
            return False

    def __enter__(self) -> ShmEmbeddingCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- locking
    def _live(self) -> Arena:
        if self._arena is None:
            raise ValueError(f"shared-memory cache {self.name!r} is closed")
        return self._arena

    def _lock(self, timeout_s: float | None = None) -> bool:
        """Take the machine-wide lock (False after `timeout_s`), then repair what a dead holder left."""
        if not self._arena_lock.acquire(self.lock_timeout_s if timeout_s is None else timeout_s):
            self._count(A_LOCK_TIMEOUTS)
            return False
        try:
            arena = self._live()
            arena.pid = self._arena_lock.pid  # NOTE: the pid a dirty mark names; changes in a forked child
            w = arena.w
            if w[A_DIRTY] or w[A_PENDING_OFF]:
                arena.recover()
            while self._unflushed:  # NOTE: only the lock holder pops, so this never pops an empty deque
                w[self._unflushed.popleft()] += 1
        except BaseException:
            self._arena_lock.release()
            raise
        return True

    def _unlock(self) -> None:
        self._arena_lock.release()

    def _count(self, word: int) -> None:
        """Count an event that happened without the lock; added to the arena's counters at the next lock."""
        self._unflushed.append(word)


def _arena_path(name: str) -> Path:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"arena name must match {_NAME_RE.pattern}, got {name!r}")
    return SHM_DIR / name


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    kb = key.encode()
    if not kb or len(key) > MAX_KEY_BYTES or len(kb) > MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} characters (and UTF-8 bytes), got {len(key)}")
    return kb
