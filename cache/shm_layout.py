"""Format of the shared-memory embedding arena: sizes, word indices of headers, and the layout dataclass.

Layout (byte offsets; every block offset is a multiple of 64):

    [0, 4096)                arena header: magic, layout, counters, LRU ends, free-list heads (int64 words)
    [4096, data_off)         hash table: `num_buckets` int64 block offsets (0 = empty), linear probing
    [data_off, +capacity)    data region: a chain of blocks, each `size` bytes, covering it end to end

    block = 192-byte header + payload (64-byte aligned) + padding to a multiple of 64
        words 0..15: tag (magic << 8 | state), size, prev_phys, gen, nbytes, link_prev, link_next, clock,
                     meta (dtype | ndim << 8 | key_len << 16), shape[4], key hash, writer pid, spare
        bytes 128..191: the key itself (compared on every lookup)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

ARENA_MAGIC = 0x31765F636E656D6D  # b"mmenc_v1" little-endian; bump the digit when the layout changes
BLOCK_MAGIC = 0x6D6D626C6B  # "mmblk"
FREE, PENDING, VALID = 1, 2, 3
ALIGN = 64
HEADER_BYTES = 4096
BLOCK_HEADER_BYTES = 192
MIN_BLOCK_BYTES = BLOCK_HEADER_BYTES  # an entry with an empty payload; also the smallest free block
MAX_KEY_BYTES = 64
MAX_NDIM = 4
KEY_OFFSET = 128  # byte offset of the key inside a block header
NUM_SIZE_CLASSES = 64  # free lists, one per power of two of block size

# Arena header words.
A_MAGIC, A_FILE_BYTES, A_CAPACITY, A_DATA_OFF, A_NUM_BUCKETS, A_MAX_ENTRIES = 0, 1, 2, 3, 4, 5
A_DIRTY, A_PENDING_OFF, A_GEN, A_CLOCK, A_LRU_HEAD, A_LRU_TAIL, A_FREE_BITMAP = 6, 7, 8, 9, 10, 11, 12
A_BYTES_USED, A_ENTRIES = 13, 14
A_HITS, A_MISSES, A_EVICTIONS, A_PUTS, A_PUT_FAILURES, A_RECOVERIES, A_LOCK_TIMEOUTS = 15, 16, 17, 18, 19, 20, 21
A_READ_RETRIES = 22
A_FREE_HEADS = 64  # 64 words: head of the free list of size class c = size.bit_length() - 1
COUNTERS = {"hits": A_HITS, "misses": A_MISSES, "evictions": A_EVICTIONS, "puts": A_PUTS,
            "put_failures": A_PUT_FAILURES, "recoveries": A_RECOVERIES, "lock_timeouts": A_LOCK_TIMEOUTS,
            "read_retries": A_READ_RETRIES}

# Block header words (relative to the block's first word).
B_TAG, B_SIZE, B_PREV_PHYS, B_GEN, B_NBYTES, B_PREV, B_NEXT, B_CLOCK, B_META = 0, 1, 2, 3, 4, 5, 6, 7, 8
B_SHAPE, B_HASH, B_PID = 9, 13, 14

TAG_FREE, TAG_PENDING, TAG_VALID = (BLOCK_MAGIC << 8 | s for s in (FREE, PENDING, VALID))


def key_hash(key: bytes) -> int:
    """Stable 63-bit hash of a key (the same in every process, unlike `hash()`)."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def block_bytes(nbytes: int) -> int:
    """Arena bytes taken by an entry with an `nbytes` payload (header + payload, rounded up to 64)."""
    return BLOCK_HEADER_BYTES + (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class ArenaLayout:
    """Sizes fixed when an arena is created.

    Args:
        capacity_bytes: size of the data region (block headers included), a multiple of 64.
        max_entries: most entries at once; the hash table has at least twice as many buckets.
    """

    capacity_bytes: int
    max_entries: int

    def __post_init__(self) -> None:
        if self.capacity_bytes < MIN_BLOCK_BYTES or self.capacity_bytes % ALIGN:
            raise ValueError(f"capacity_bytes must be a multiple of {ALIGN} >= {MIN_BLOCK_BYTES}, "
                             f"got {self.capacity_bytes}")
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries}")

    @classmethod
    def for_capacity(cls, capacity_bytes: int, max_entries: int | None = None) -> ArenaLayout:
        """Layout for a requested capacity (rounded down to 64); by default one entry per 4 KiB, 256..4M."""
        capacity = capacity_bytes // ALIGN * ALIGN
        if max_entries is None:
            max_entries = min(max(capacity // 4096, 256), 1 << 22)
        return cls(capacity, max_entries)

    @property
    def num_buckets(self) -> int:
        return 1 << (2 * self.max_entries - 1).bit_length()

    @property
    def data_off(self) -> int:
        return -(-(HEADER_BYTES + 8 * self.num_buckets) // 4096) * 4096

    @property
    def file_bytes(self) -> int:
        return self.data_off + self.capacity_bytes
