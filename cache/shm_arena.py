"""The index and allocator of the shared-memory embedding arena, laid out in one flat buffer.

Everything here is plain reads and writes of int64 words in a buffer shared by processes; it knows nothing
of locks, tensors or files. The caller (`cache.shm.ShmEmbeddingCache`) holds the arena lock around every
call, and brackets each mutation with `begin()` / `end()` so that a holder that dies mid-way leaves a mark
the next holder repairs with `recover()`.

The byte layout is in `cache.shm_layout`.

A block is FREE (on the free list of its size class), PENDING (reserved by a writer that is copying its
payload; on no list) or VALID (in the hash table and on the LRU list). link_prev / link_next serve the
free list or the LRU list, whichever the block is on.

NOTE: crash safety. Mutations run between `begin()` (dirty word := pid) and `end()` (dirty := 0). A holder
killed in between leaves the dirty word set; the next holder calls `recover()`, which rebuilds the hash
table, LRU list and free lists from the block chain. The chain stays walkable at every single store:
a split writes the remainder's header before shrinking the block, a merge only grows a size. A writer
killed while copying a payload (outside a dirty section) leaves `pending_off` set; recovery frees that
block. A rebuild that finds the chain itself broken drops every entry (never serves a doubtful one).
"""

from __future__ import annotations

import os

import numpy as np

from cache.shm_layout import (
    A_BYTES_USED,
    A_CAPACITY,
    A_CLOCK,
    A_DATA_OFF,
    A_DIRTY,
    A_ENTRIES,
    A_EVICTIONS,
    A_FILE_BYTES,
    A_FREE_BITMAP,
    A_FREE_HEADS,
    A_GEN,
    A_LRU_HEAD,
    A_LRU_TAIL,
    A_MAGIC,
    A_MAX_ENTRIES,
    A_NUM_BUCKETS,
    A_PENDING_OFF,
    A_PUTS,
    A_RECOVERIES,
    ALIGN,
    ARENA_MAGIC,
    B_CLOCK,
    B_GEN,
    B_HASH,
    B_META,
    B_NBYTES,
    B_NEXT,
    B_PREV,
    B_PREV_PHYS,
    B_SIZE,
    B_TAG,
    BLOCK_MAGIC,
    HEADER_BYTES,
    KEY_OFFSET,
    MAX_KEY_BYTES,
    MAX_NDIM,
    MIN_BLOCK_BYTES,
    NUM_SIZE_CLASSES,
    TAG_FREE,
    TAG_PENDING,
    TAG_VALID,
    ArenaLayout,
    block_bytes,
    key_hash,
)

_MAX_CLASS_SCAN = 16  # free blocks looked at in the request's own size class before going one class up


class Arena:
    """Index, LRU and allocator over a shared buffer. Every method expects the caller to hold the arena lock.

    Args:
        buf: a writable buffer (the mmap of the arena file) laid out as in `cache.shm_layout`.
    """

    def __init__(self, buf: memoryview | bytearray) -> None:
        self.mv = memoryview(buf)
        self.w = self.mv.cast("q")  # NOTE: one int64 store per item assignment, so a single word never tears
        self.u8 = np.frombuffer(buf, dtype=np.uint8)
        self.pid = os.getpid()
        self._load_layout()

    def _load_layout(self) -> None:
        w = self.w
        self.capacity, self.data_off = w[A_CAPACITY], w[A_DATA_OFF]
        self.data_end = self.data_off + self.capacity
        self.num_buckets, self.max_entries = w[A_NUM_BUCKETS], w[A_MAX_ENTRIES]
        self.table_w = HEADER_BYTES >> 3

    def release(self) -> None:
        """Drop the views of the buffer (so its owner can close it)."""
        self.w.release()
        self.mv.release()
        self.u8 = None  # type: ignore[assignment]

    # ----------------------------------------------------------------------------------------- format, recovery
    def format(self, layout: ArenaLayout) -> None:
        """Write an empty arena into a zero-filled buffer; the magic word goes last (an arena is valid once set)."""
        w = self.w
        w[A_FILE_BYTES], w[A_CAPACITY], w[A_DATA_OFF] = layout.file_bytes, layout.capacity_bytes, layout.data_off
        w[A_NUM_BUCKETS], w[A_MAX_ENTRIES] = layout.num_buckets, layout.max_entries
        self._load_layout()
        self.clear()
        w[A_MAGIC] = ARENA_MAGIC

    def clear(self) -> None:
        """Drop every entry (counters are kept): empty table, one free block covering the data region."""
        w = self.w
        self.begin()
        self.u8[HEADER_BYTES:self.data_off] = 0
        for c in range(NUM_SIZE_CLASSES):
            w[A_FREE_HEADS + c] = 0
        w[A_FREE_BITMAP] = w[A_LRU_HEAD] = w[A_LRU_TAIL] = w[A_BYTES_USED] = w[A_ENTRIES] = w[A_PENDING_OFF] = 0
        self._write_free(self.data_off, self.capacity, 0)
        self._free_push(self.data_off)
        self.end()

    def begin(self) -> None:
        self.w[A_DIRTY] = self.pid

    def end(self) -> None:
        self.w[A_DIRTY] = 0

    def recover(self) -> None:
        """Repair what a dead lock holder left: rebuild the index when it died mid-mutation, else free its
        half-written (PENDING) block."""
        w = self.w
        w[A_RECOVERIES] += 1
        if w[A_DIRTY]:
            self.rebuild()
            return
        off = w[A_PENDING_OFF]
        self.begin()
        if self.data_off <= off < self.data_end and w[(off >> 3) + B_TAG] == TAG_PENDING:
            w[A_BYTES_USED] -= w[(off >> 3) + B_SIZE]
            self._free(off)
        w[A_PENDING_OFF] = 0
        self.end()

    def rebuild(self) -> None:
        """Rebuild table, LRU and free lists from the block chain; VALID blocks survive, all else becomes free."""
        w = self.w
        self.begin()
        blocks: list[list[int]] = []  # [offset, size, is_valid]
        newest: dict[bytes, int] = {}  # key -> index in `blocks` of its newest VALID block
        off = self.data_off
        while off < self.data_end:
            b = off >> 3
            tag, size = w[b + B_TAG], w[b + B_SIZE]
            if tag >> 8 != BLOCK_MAGIC or size < MIN_BLOCK_BYTES or size % ALIGN or off + size > self.data_end:
                self.clear()  # the chain itself is broken: serve nothing rather than something doubtful
                return
            is_valid = tag == TAG_VALID and self._header_is_sane(off)
            if is_valid:  # a replace cut short can leave two VALID blocks of one key: keep the newer
                key = self.key_at(off)
                other = newest.get(key)
                if other is None or w[(blocks[other][0] >> 3) + B_GEN] < w[b + B_GEN]:
                    if other is not None:
                        blocks[other][2] = 0
                    newest[key] = len(blocks)
                else:
                    is_valid = False
            blocks.append([off, size, int(is_valid)])
            off += size

        self.u8[HEADER_BYTES:self.data_off] = 0
        for c in range(NUM_SIZE_CLASSES):
            w[A_FREE_HEADS + c] = 0
        w[A_FREE_BITMAP] = w[A_LRU_HEAD] = w[A_LRU_TAIL] = w[A_BYTES_USED] = w[A_ENTRIES] = w[A_PENDING_OFF] = 0
        valid: list[tuple[int, int]] = []  # (clock, offset)
        prev, run_start, run_size = 0, 0, 0
        for o, s, v in blocks + [[self.data_end, 0, 1]]:  # the sentinel flushes the last free run
            if not v:
                run_start, run_size = (run_start, run_size + s) if run_size else (o, s)
                continue
            if run_size:
                self._write_free(run_start, run_size, prev)
                self._free_push(run_start)
                prev, run_size = run_start, 0
            if o < self.data_end:
                w[(o >> 3) + B_PREV_PHYS] = prev
                valid.append((w[(o >> 3) + B_CLOCK], o))
                prev = o
        for _, o in sorted(valid):  # oldest first, so the newest ends at the LRU head
            b = o >> 3
            w[b + B_HASH] = key_hash(self.key_at(o))
            self._index_insert(o)
            self._lru_push_front(o)
            w[A_BYTES_USED] += w[b + B_SIZE]
            w[A_ENTRIES] += 1
        self.end()

    def _header_is_sane(self, off: int) -> bool:
        b, w = off >> 3, self.w
        meta = w[b + B_META]
        ndim, key_len = (meta >> 8) & 0xFF, (meta >> 16) & 0xFF
        return (meta & 0xFF != 0 and ndim <= MAX_NDIM and 0 < key_len <= MAX_KEY_BYTES and 0 <= w[b + B_NBYTES]
                and block_bytes(w[b + B_NBYTES]) <= w[b + B_SIZE])

    # ----------------------------------------------------------------------------------------- lookups
    def key_at(self, off: int) -> bytes:
        key_len = (self.w[(off >> 3) + B_META] >> 16) & 0xFF
        return bytes(self.mv[off + KEY_OFFSET:off + KEY_OFFSET + key_len])

    def find(self, key: bytes, h: int) -> int:
        """Offset of the VALID block holding `key`, or 0."""
        w, mask, t = self.w, self.num_buckets - 1, self.table_w
        i = h & mask
        for _ in range(self.num_buckets):
            off = w[t + i]
            if off == 0:
                return 0
            b = off >> 3
            if w[b + B_HASH] == h and w[b + B_TAG] == TAG_VALID and self.key_at(off) == key:
                return off
            i = (i + 1) & mask
        return 0

    def _index_insert(self, off: int) -> None:
        w, mask, t = self.w, self.num_buckets - 1, self.table_w
        i = w[(off >> 3) + B_HASH] & mask
        while w[t + i]:
            i = (i + 1) & mask
        w[t + i] = off

    def _index_delete(self, off: int) -> None:
        """Remove `off` from the table by backward shift (no tombstones, so probes stay short)."""
        w, mask, t = self.w, self.num_buckets - 1, self.table_w
        i = w[(off >> 3) + B_HASH] & mask
        while w[t + i] != off:
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            o = w[t + j]
            if o == 0:
                break
            home = w[(o >> 3) + B_HASH] & mask
            if (i < j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                w[t + i] = o
                i = j
        w[t + i] = 0

    # ----------------------------------------------------------------------------------------- LRU list
    def _lru_push_front(self, off: int) -> None:
        w, b = self.w, off >> 3
        head = w[A_LRU_HEAD]
        w[b + B_PREV], w[b + B_NEXT] = 0, head
        if head:
            w[(head >> 3) + B_PREV] = off
        else:
            w[A_LRU_TAIL] = off
        w[A_LRU_HEAD] = off

    def _lru_unlink(self, off: int) -> None:
        w, b = self.w, off >> 3
        prev, nxt = w[b + B_PREV], w[b + B_NEXT]
        if prev:
            w[(prev >> 3) + B_NEXT] = nxt
        else:
            w[A_LRU_HEAD] = nxt
        if nxt:
            w[(nxt >> 3) + B_PREV] = prev
        else:
            w[A_LRU_TAIL] = prev

    def touch(self, off: int) -> None:
        """Mark a VALID block most recently used."""
        w = self.w
        self.begin()
        w[A_CLOCK] += 1
        w[(off >> 3) + B_CLOCK] = w[A_CLOCK]
        if w[A_LRU_HEAD] != off:
            self._lru_unlink(off)
            self._lru_push_front(off)
        self.end()

    # ----------------------------------------------------------------------------------------- allocator
    def _write_free(self, off: int, size: int, prev_phys: int) -> None:
        w, b = self.w, off >> 3
        w[b + B_SIZE], w[b + B_PREV_PHYS] = size, prev_phys
        w[b + B_TAG] = TAG_FREE

    def _free_push(self, off: int) -> None:
        w, b = self.w, off >> 3
        c = w[b + B_SIZE].bit_length() - 1
        head = w[A_FREE_HEADS + c]
        w[b + B_PREV], w[b + B_NEXT] = 0, head
        if head:
            w[(head >> 3) + B_PREV] = off
        w[A_FREE_HEADS + c] = off
        w[A_FREE_BITMAP] |= 1 << c

    def _free_remove(self, off: int) -> None:
        w, b = self.w, off >> 3
        c = w[b + B_SIZE].bit_length() - 1
        prev, nxt = w[b + B_PREV], w[b + B_NEXT]
        if prev:
            w[(prev >> 3) + B_NEXT] = nxt
        else:
            w[A_FREE_HEADS + c] = nxt
            if not nxt:
                w[A_FREE_BITMAP] &= ~(1 << c)
        if nxt:
            w[(nxt >> 3) + B_PREV] = prev

    def _alloc(self, need: int) -> int:
        """A free block of at least `need` bytes (good fit: own size class first, then the next non-empty one)."""
        w = self.w
        c = need.bit_length() - 1
        off = w[A_FREE_HEADS + c]
        for _ in range(_MAX_CLASS_SCAN):
            if not off or w[(off >> 3) + B_SIZE] >= need:
                break
            off = w[(off >> 3) + B_NEXT]
        if not off or w[(off >> 3) + B_SIZE] < need:
            higher = w[A_FREE_BITMAP] >> (c + 1)
            if not higher:
                return 0
            off = w[A_FREE_HEADS + c + (higher & -higher).bit_length()]
        return self._take(off, need)

    def _take(self, off: int, need: int) -> int:
        """Cut `need` bytes off the front of free block `off` (the rest stays free) and mark them PENDING."""
        w, b = self.w, off >> 3
        self._free_remove(off)
        size = w[b + B_SIZE]
        if size - need >= MIN_BLOCK_BYTES:
            rest = off + need
            self._write_free(rest, size - need, off)  # NOTE: written before the size shrinks (walkable chain)
            if rest + size - need < self.data_end:
                w[((rest + size - need) >> 3) + B_PREV_PHYS] = rest
            self._free_push(rest)
            w[b + B_SIZE] = need
        w[b + B_TAG] = TAG_PENDING
        return off

    def _free(self, off: int) -> int:
        """Return a block to the free lists, merged with free neighbours; returns the merged block's offset."""
        w = self.w
        b = off >> 3
        w[b + B_TAG] = TAG_FREE
        size = w[b + B_SIZE]
        nxt = off + size
        if nxt < self.data_end and w[(nxt >> 3) + B_TAG] == TAG_FREE:
            self._free_remove(nxt)
            size += w[(nxt >> 3) + B_SIZE]
        prev = w[b + B_PREV_PHYS]
        if prev and w[(prev >> 3) + B_TAG] == TAG_FREE:
            self._free_remove(prev)
            size += w[(prev >> 3) + B_SIZE]
            off = prev
        w[(off >> 3) + B_SIZE] = size
        if off + size < self.data_end:
            w[((off + size) >> 3) + B_PREV_PHYS] = off
        self._free_push(off)
        return off

    # ----------------------------------------------------------------------------------------- entries
    def reserve(self, key: bytes, h: int, need: int) -> int:
        """Drop `key`'s entry, then evict least-recently-used entries until a block of `need` bytes fits;
        returns it PENDING (0: cannot fit even in an empty arena).

        The block is recorded in `pending_off` until `publish` or `abandon`, so a holder that dies while
        copying the payload has its block freed by the next `recover()`.
        """
        w = self.w
        self.begin()
        old = self.find(key, h)
        if old:  # replaced in place: a re-put never evicts another entry to keep the old copy around
            self._drop(old)
            self._free(old)
        while w[A_ENTRIES] >= self.max_entries and w[A_LRU_TAIL]:
            self._evict(w[A_LRU_TAIL])
        off = self._alloc(need)
        while not off and w[A_LRU_TAIL]:
            merged = self._evict(w[A_LRU_TAIL])
            if w[(merged >> 3) + B_SIZE] >= need:
                off = self._take(merged, need)
        if off:
            w[A_BYTES_USED] += w[(off >> 3) + B_SIZE]
            w[A_PENDING_OFF] = off
        self.end()
        return off

    def _evict(self, off: int) -> int:
        self._drop(off)
        self.w[A_EVICTIONS] += 1
        return self._free(off)

    def _drop(self, off: int) -> None:
        w = self.w
        self._index_delete(off)
        self._lru_unlink(off)
        w[A_BYTES_USED] -= w[(off >> 3) + B_SIZE]
        w[A_ENTRIES] -= 1

    def publish(self, off: int, h: int) -> None:
        """Make a PENDING block (header, key and payload written) VALID: in the table, at the LRU head."""
        w = self.w
        self.begin()
        w[A_GEN] += 1
        w[A_CLOCK] += 1
        b = off >> 3
        w[b + B_GEN], w[b + B_CLOCK], w[b + B_HASH] = w[A_GEN], w[A_CLOCK], h
        w[b + B_TAG] = TAG_VALID
        self._index_insert(off)
        self._lru_push_front(off)
        w[A_ENTRIES] += 1
        w[A_PUTS] += 1
        w[A_PENDING_OFF] = 0
        self.end()

    def abandon(self, off: int) -> None:
        """Free a PENDING block whose payload will not be written."""
        w = self.w
        self.begin()
        w[A_BYTES_USED] -= w[(off >> 3) + B_SIZE]
        self._free(off)
        w[A_PENDING_OFF] = 0
        self.end()
