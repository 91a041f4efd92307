"""SWA-aware radix prefix cache (issue 6, section 3; the MiMo article, section 2.1 "SWA-aware prefix cache tree").

A radix tree over token ids, token-granular (page size 1). Each node owns, for its run of tokens, the
full-attention KV slots (`full`, always live) and the SWA KV slots (`swa`, -1 where evicted or never kept).

Window safety. The window W counts the query: the token at position p attends to keys p-W+1..p. A request
that reuses a prefix of length L computes positions L, L+1, ...; position L+j reads SWA keys
[L+j-W+1, L+j], of which the cached ones lie in [L-W+1, L). So a prefix of length L is reusable iff

    the SWA KV of positions [max(0, L-W+1), L) is live        (the last W-1 tokens of the prefix)

The issue and the article say "the last W tokens"; that is one more than needed (the W-th is the query
itself, which the request computes). We use the exact W-1, so a match is never shorter than necessary.
`match_prefix` walks as far as tokens match (the naive "equal tokens" length M), then trims back to the
longest window-safe L <= M; the part beyond L is a miss.

Ownership. Every slot is free in its `SlotAllocator`, owned by exactly one tree node, or held by one
request. Slots that `match_prefix` returns stay owned by the tree; the caller locks the match while it uses
them and must not free them (when it releases out-of-window SWA, it just forgets tree-owned entries). A
match hands out SWA slots only for the window [L-W+1, L) the request reads; earlier positions are -1.
`insert` takes ownership of all slots passed: positions already in the tree keep the tree's slots and the
caller's different ones are freed (equal ones are the tree's own, returned by the match); tree SWA entries
that are -1 are filled from the caller's live SWA slots. Call `insert` before `unlock`.

Locks. `lock(match.node)` protects the full slots of the whole path root..match end (full attention reads
them all) but the SWA slots only of the window [L-W+1, L): a match and an insert cut the path at the start
of the window at their end as well as at the end, so a lock pins exactly W-1 SWA slots and the SWA of older
parts of a running request's prefix stays evictable. `unlock_swa` turns a lock into one of the full path
only (for a request whose queries have moved past the window).

How the scheduler uses it: it inserts every prefill chunk as soon as it is computed, with all of its SWA
live, and re-locks the request at the chunk's end; so the tree holds the SWA of whole prompts and a later
request that branches anywhere inside one (a shared system prompt) gets a window-safe hit. `keep_swa` is for
callers that insert only when a request finishes (the prefix-cache benchmark's simulation).

Eviction is LRU over both pools, with two clocks: a node's full clock ticks whenever a match or insert
passes through it, its SWA clock only when its positions lie in the window at the end of a match or an
insert (`recent=True`), so SWA that no later match needed ages out even on a hot path; SWA whose clock never
ticked (inside a prompt, or at prefill-chunk boundaries, inserted with `recent=False`) goes first.
`evict(num_full, ...)` drops unlocked leaves, least recent full clock first (freeing full and live SWA);
`evict(.., num_swa)` tombstones the SWA of nodes, least recent SWA clock first, internal nodes included,
keeping their full slots: the prefix stays reusable as long as a later window is live. A leaf whose SWA is
gone is useless (no position in it can end a window-safe match, for W > 1), so SWA eviction drops an
unlocked leaf whole.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine_link.engine.kv_pool import SlotAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)


class _Node:
    """A run of tokens with their full and SWA slots; children keyed by their first token."""

    __slots__ = ("key", "full", "swa", "children", "parent", "lock_ref", "swa_locks", "swa_lock_ref",
                 "full_clock", "swa_clock", "num_live_swa", "serial")
    _serials = itertools.count()  # NOTE: breaks LRU ties deterministically (id() would vary between runs)

    def __init__(self, key: torch.Tensor, full: torch.Tensor, swa: torch.Tensor, parent: _Node | None,
                 full_clock: int = 0, swa_clock: int = 0) -> None:
        self.key = key  # [n] token ids
        self.full = full  # [n] full-attention slots
        self.swa = swa  # [n] SWA slots, -1 where not live
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.lock_ref = 0  # locks whose path passes here (protects full, and keeps the node)
        self.swa_locks: dict[int, int] = {}  # window start -> locks whose window overlaps this node
        self.swa_lock_ref = 0  # sum of swa_locks (protects SWA)
        self.full_clock, self.swa_clock = full_clock, swa_clock
        self.num_live_swa = int((swa >= 0).sum())
        self.serial = next(_Node._serials)

    def __len__(self) -> int:
        return self.key.numel()


@dataclass(frozen=True, eq=False)
class _Handle:
    """Lock handle: the node where a match ends, the match length (its depth), and whether a lock through it
    also protects the SWA of its window (`unlock_swa` hands out one that does not)."""

    node: _Node
    length: int
    swa: bool = True


@dataclass
class PrefixMatch:
    """Result of `SwaRadixCache.match_prefix`.

    Attributes:
        length: window-safe reusable prefix length (already trimmed).
        full_slots: int64 `[length]` full-attention slots of the prefix (owned by the tree).
        swa_slots: int64 `[length]` SWA slots, live for the window [length-W+1, length) and -1 before it.
        node: lock handle; pass to `lock` / `unlock`.
        naive_length: tokens matched before trimming (what the naive "equal tokens" rule would reuse).
        keep_swa: positions [lo, hi) whose own SWA slots the request should keep (not release) until `insert`:
            the window at the point where it leaves the tree, which the tree lacks when the match was trimmed.
            `insert` fills the tree from them, so the next request that branches there gets a window-safe hit
            (a shared system prompt, say). (0, 0) when nothing is worth keeping. Costs <= W-1 SWA slots.
            A caller that inserts every prefill chunk with its SWA live (the scheduler) keeps it anyway.
    """

    length: int
    full_slots: torch.Tensor
    swa_slots: torch.Tensor
    node: object
    naive_length: int = field(default=0)
    keep_swa: tuple[int, int] = field(default=(0, 0))


class NodeView(NamedTuple):
    """One node as `SwaRadixCache.walk` reports it."""

    path: list[int]  # tokens from the root to the node's end
    full: torch.Tensor  # [n] the node's full slots (its last n positions of `path`)
    swa: torch.Tensor  # [n] its SWA slots, -1 where not live
    is_locked: bool
    is_swa_locked: bool


def window_safe_length(swa: torch.Tensor, window: int) -> int:
    """Longest L <= len(swa) whose SWA positions [max(0, L-W+1), L) are all live (>= 0).

    The answer is len(swa) or a dead position: if L is safe and swa[L] is live, L+1 is safe too.
    """
    dead = torch.nonzero(swa < 0).flatten()  # [D] ascending
    if dead.numel() == 0 or window <= 1:
        return swa.numel()
    candidates = torch.cat([dead, torch.tensor([swa.numel()])])  # [D+1] candidate L, ascending
    prev_dead = torch.cat([torch.tensor([-window]), dead])  # [D+1] last dead position before each candidate
    safe = prev_dead <= candidates - window  # [D+1]; candidates[0] is always safe
    return int(candidates[safe].max())


class SwaRadixCache:
    """Prefix tree with separate full-attention and SWA slots per node and window-safe matching.

    Args:
        full: allocator of the full-attention pool (freed slots go back here).
        swa: allocator of the SWA pool.
        window: sliding window W, counting the query.
    """

    def __init__(self, full: SlotAllocator, swa: SlotAllocator, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.full_pool, self.swa_pool, self.window = full, swa, window
        self.root = _Node(_EMPTY, _EMPTY, _EMPTY, None)
        self.root.lock_ref = 1  # never evicted
        self._clock = 0
        self._num_full = self._num_swa = 0  # tree-owned slots
        self._evictable_full = 0  # full slots of unlocked nodes
        self._evictable_swa = 0  # live SWA slots of nodes without an SWA lock

    # ------------------------------------------------------------------------------------------------ lookup

    def match_prefix(self, tokens: Sequence[int], *, recent: bool = True) -> PrefixMatch:
        """Longest window-safe cached prefix of `tokens` (marks it recently used).

        A caller that needs logits for the last prompt token passes `tokens[:-1]`. The returned slots stay
        owned by the tree: `lock(match.node)` before using them, `insert`, then `unlock`. `recent=False` leaves
        the SWA clocks alone (see `insert`).
        """
        path, fulls, swas = self._walk(_as_key(tokens))
        swa_all = torch.cat(swas) if swas else _EMPTY  # [M]
        length = window_safe_length(swa_all, self.window)
        node, start = self.root, 0
        for n in path:  # the node whose path ends exactly at `length`, split if `length` falls inside one
            if start >= length:
                break
            if start + len(n) > length:
                n = self._split(n, length - start, start)
            node, start = n, start + len(n)
        self._cut_window(node, length)
        self._clock += 1
        self._touch(node, length, swa=recent)
        full_out = (torch.cat(fulls) if fulls else _EMPTY)[:length].clone()  # [L]
        swa_out = swa_all[:length].clone()  # [L]
        swa_out[:self._window_start(length)] = -1  # NOTE: only the window is handed out (and SWA-locked)
        naive = swa_all.numel()
        keep = (max(length, self._window_start(naive)), naive) if naive > length and self.window > 1 else (0, 0)
        return PrefixMatch(length, full_out, swa_out, _Handle(node, length), naive, keep)

    def match_length(self, tokens: Sequence[int]) -> int:
        """Window-safe match length of `tokens`, without side effects (for queue ordering estimates)."""
        swas = self._walk(_as_key(tokens))[2]
        return window_safe_length(torch.cat(swas) if swas else _EMPTY, self.window)

    def naive_match_length(self, tokens: Sequence[int]) -> int:
        """Tokens matched by the naive "equal tokens" rule (no window check, no side effects)."""
        return sum(s.numel() for s in self._walk(_as_key(tokens))[2])

    def _walk(self, key: torch.Tensor) -> tuple[list[_Node], list[torch.Tensor], list[torch.Tensor]]:
        """Nodes along the token match of `key` and their matched full / SWA slot segments."""
        path, fulls, swas = [], [], []
        node, pos = self.root, 0
        while pos < key.numel():
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            k = _common_prefix(child.key, key[pos:])
            path.append(child)
            fulls.append(child.full[:k])
            swas.append(child.swa[:k])
            if k < len(child):
                break
            node, pos = child, pos + k
        return path, fulls, swas

    # ------------------------------------------------------------------------------------------------ locks

    def lock(self, node: object) -> None:
        """Protect a match until `unlock`: full slots of its whole path, SWA slots of the nodes in its window."""
        handle = _as_handle(node)
        lo = self._window_start(handle.length) if handle.swa else handle.length  # no SWA part: an empty window
        for n, _, end in self._path_up(handle.node, handle.length):
            if n.lock_ref == 0:
                self._evictable_full -= len(n)
            n.lock_ref += 1
            if end > lo:  # overlaps the window [lo, length)
                if n.swa_lock_ref == 0:
                    self._evictable_swa -= n.num_live_swa
                n.swa_lock_ref += 1
                n.swa_locks[lo] = n.swa_locks.get(lo, 0) + 1

    def unlock(self, node: object) -> None:
        """Undo one `lock` of the same handle.

        Raises:
            ValueError: the handle is not locked (nothing changes).
        """
        handle = _as_handle(node)
        lo = self._window_start(handle.length) if handle.swa else handle.length
        path = list(self._path_up(handle.node, handle.length))
        if any(n.lock_ref <= 0 or (end > lo and n.swa_locks.get(lo, 0) <= 0) for n, _, end in path):
            raise ValueError("unlock of a match that is not locked")
        for n, _, end in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable_full += len(n)
            if end > lo:
                n.swa_lock_ref -= 1
                n.swa_locks[lo] -= 1
                if not n.swa_locks[lo]:
                    del n.swa_locks[lo]
                if n.swa_lock_ref == 0:
                    self._evictable_swa += n.num_live_swa

    def unlock_swa(self, node: object) -> object:
        """Drop the SWA part of one `lock` of `node`, keeping its full path locked (for a request whose queries
        have moved past the match's window: the tree keeps that SWA only while memory allows).

        Returns:
            The handle to `unlock` from now on (`node` itself if its lock holds no SWA).
        """
        handle = _as_handle(node)
        if not handle.swa:
            return handle
        full_only = _Handle(handle.node, handle.length, swa=False)
        self.lock(full_only)
        self.unlock(handle)
        return full_only

    # ------------------------------------------------------------------------------------------------ insert

    def insert(self, tokens: Sequence[int], full_slots: torch.Tensor, swa_slots: torch.Tensor, *,
               recent: bool = True) -> int:
        """Cache `tokens` with their slots, taking ownership of every slot passed.

        Args:
            tokens: token ids `[N]`.
            full_slots: int64 `[N]` full-attention slots (all >= 0).
            swa_slots: int64 `[N]` SWA slots; -1 for positions the request already released.
            recent: whether the window at the end counts as recently used for SWA eviction. False for a prefill
                chunk boundary, where later matches rarely end: its SWA should not outlast the windows where
                sequences and prompts end (what multi-turn and repeated requests reuse).
        Returns:
            How many leading tokens were already in the tree (the caller's different slots for them are freed).
        Raises:
            ValueError: lengths differ, a full slot is < 0, or a slot passed is free in its pool.
        """
        key = _as_key(tokens)  # [N]
        full = torch.as_tensor(full_slots, dtype=torch.int64).reshape(-1)  # [N]
        swa = torch.as_tensor(swa_slots, dtype=torch.int64).reshape(-1)  # [N]
        if not key.numel() == full.numel() == swa.numel():
            raise ValueError(f"tokens/full/swa lengths differ: {key.numel()}, {full.numel()}, {swa.numel()}")
        if key.numel() and (int(full.min()) < 0 or bool(self.full_pool.is_free(full).any())):
            raise ValueError("insert: full slots must be >= 0 and owned by the caller (not free)")
        if bool(self.swa_pool.is_free(swa[swa >= 0]).any()):
            raise ValueError("insert: SWA slots must be owned by the caller (not free)")
        self._clock += 1
        node, pos = self.root, 0
        while pos < key.numel():
            child = node.children.get(int(key[pos]))
            if child is None:
                leaf = _Node(key[pos:].clone(), full[pos:].clone(), swa[pos:].clone(), node)
                node.children[int(key[pos])] = leaf
                self._num_full += len(leaf)
                self._evictable_full += len(leaf)
                self._num_swa += leaf.num_live_swa
                self._evictable_swa += leaf.num_live_swa
                self._cut_window(leaf, key.numel())
                self._touch(leaf, key.numel(), swa=recent)
                return pos
            k = _common_prefix(child.key, key[pos:])
            if k < len(child):
                child = self._split(child, k, pos)
            self._take_duplicates(child, full[pos:pos + k], swa[pos:pos + k])
            node, pos = child, pos + k
        self._cut_window(node, pos)
        self._touch(node, pos, swa=recent)
        return pos

    def _take_duplicates(self, node: _Node, full: torch.Tensor, swa: torch.Tensor) -> None:
        """The caller's slots for positions `node` already holds: free what differs, fill dead SWA."""
        self.full_pool.free(full[full != node.full])
        fill = (node.swa < 0) & (swa >= 0)  # [n]
        self.swa_pool.free(swa[(swa != node.swa) & ~fill])
        num_fill = int(fill.sum())
        if num_fill:
            node.swa = torch.where(fill, swa, node.swa)
            self._add_live_swa(node, num_fill)

    # ------------------------------------------------------------------------------------------------ evict

    def evict(self, num_full: int, num_swa: int) -> tuple[int, int]:
        """Free at least `num_full` full and `num_swa` SWA slots (fewer only when not that many are evictable).

        Full: drop unlocked leaves, least recently used first. SWA: tombstone the SWA of nodes without an SWA
        lock, least recently used (SWA clock) first; an unlocked leaf goes whole.

        Returns:
            (full slots freed, SWA slots freed).
        """
        freed_full = freed_swa = 0
        if num_full > 0:
            heap = [(n.full_clock, n.serial, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
            heapq.heapify(heap)
            while heap and freed_full < num_full:
                node = heapq.heappop(heap)[2]
                parent = node.parent
                f, s = self._drop(node)
                freed_full, freed_swa = freed_full + f, freed_swa + s
                if parent is not self.root and not parent.children and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.full_clock, parent.serial, parent))
        if freed_swa < num_swa:
            heap = [(n.swa_clock, n.serial, n) for n in self._nodes() if n.num_live_swa and n.swa_lock_ref == 0]
            heapq.heapify(heap)
            while heap and freed_swa < num_swa:
                node = heapq.heappop(heap)[2]
                if node.parent is None or not node.num_live_swa:
                    continue  # dropped by a cascade below
                if node.children or node.lock_ref or self.window <= 1:
                    freed_swa += self._tombstone(node)
                    continue
                while True:  # a leaf without live SWA is useless: drop it, and parents left that way
                    parent = node.parent
                    f, s = self._drop(node)
                    freed_full, freed_swa = freed_full + f, freed_swa + s
                    if parent is self.root or parent.children or parent.lock_ref or parent.num_live_swa:
                        break
                    node = parent
        return freed_full, freed_swa

    def evictable_full(self) -> int:
        """Full slots `evict` can free now (those of unlocked nodes)."""
        return self._evictable_full

    def evictable_swa(self) -> int:
        """Live SWA slots `evict` can free now (those of nodes without an SWA lock)."""
        return self._evictable_swa

    def cached_full(self) -> int:
        """Full-attention slots owned by the tree."""
        return self._num_full

    def cached_swa(self) -> int:
        """Live SWA slots owned by the tree."""
        return self._num_swa

    def walk(self) -> Iterator[NodeView]:
        """Every node (not the root), parents before children; for checks, tests and stats."""
        stack: list[tuple[_Node, list[int]]] = [(c, []) for c in self.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.key.tolist()
            yield NodeView(path, node.full.clone(), node.swa.clone(), node.lock_ref > 0, node.swa_lock_ref > 0)
            stack.extend((c, path) for c in node.children.values())

    # ------------------------------------------------------------------------------------------------ internals

    def _window_start(self, length: int) -> int:
        """First position of the SWA window a prefix of `length` needs: [start, length)."""
        return max(0, length - self.window + 1)

    def _path_up(self, node: _Node, end: int) -> Iterator[tuple[_Node, int, int]]:
        """(node, start, end) from `node` (ending at depth `end`) up to the root, root excluded."""
        while node is not self.root:
            start = end - len(node)
            yield node, start, end
            node, end = node.parent, start

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _cut_window(self, node: _Node, end: int) -> None:
        """Make the window start of the prefix ending at `node` (depth `end`) a node boundary, so that a lock pins
        the SWA of the window and no more, and the clocks tick for exactly the window."""
        lo = self._window_start(end)
        for n, start, stop in self._path_up(node, end):
            if stop <= lo:
                return
            if start < lo:
                self._split(n, lo - start, start)
                return

    def _touch(self, node: _Node, end: int, swa: bool = True) -> None:
        """Full clock on the path to `node` (ending at depth `end`), SWA clock on the nodes in its window."""
        lo = self._window_start(end) if swa else end
        for n, _, stop in self._path_up(node, end):
            n.full_clock = self._clock
            if stop > lo:
                n.swa_clock = self._clock

    def _split(self, node: _Node, k: int, start: int) -> _Node:
        """Cut `node` (starting at depth `start`) after k tokens, 0 < k < len; returns the new upper node."""
        upper = _Node(node.key[:k].clone(), node.full[:k].clone(), node.swa[:k].clone(), node.parent,
                      node.full_clock, node.swa_clock)
        node.key, node.full, node.swa = node.key[k:].clone(), node.full[k:].clone(), node.swa[k:].clone()
        node.num_live_swa -= upper.num_live_swa
        upper.lock_ref = node.lock_ref  # every lock through `node` passes through its new parent
        # NOTE: the lower part keeps every SWA lock (their windows end at or below it); the upper part only
        # those whose window starts before the cut.
        upper.swa_locks = {lo: c for lo, c in node.swa_locks.items() if lo < start + k}
        upper.swa_lock_ref = sum(upper.swa_locks.values())
        if node.swa_lock_ref and not upper.swa_lock_ref:
            self._evictable_swa += upper.num_live_swa
        node.parent.children[int(upper.key[0])] = upper
        upper.children[int(node.key[0])] = node
        node.parent = upper
        return upper

    def _drop(self, node: _Node) -> tuple[int, int]:
        """Remove an unlocked leaf, freeing its full and live SWA slots."""
        assert not node.children and node.lock_ref == 0 and node is not self.root
        num_full, num_swa = len(node), node.num_live_swa
        self.full_pool.free(node.full)
        self.swa_pool.free(node.swa)
        del node.parent.children[int(node.key[0])]
        node.parent = None
        self._num_full -= num_full
        self._evictable_full -= num_full
        self._add_live_swa(node, -num_swa)
        return num_full, num_swa

    def _tombstone(self, node: _Node) -> int:
        """Free the live SWA slots of a node without an SWA lock, keeping its full slots."""
        assert node.swa_lock_ref == 0
        num_swa = node.num_live_swa
        self.swa_pool.free(node.swa)
        node.swa = torch.full_like(node.swa, -1)
        self._add_live_swa(node, -num_swa)
        return num_swa

    def _add_live_swa(self, node: _Node, delta: int) -> None:
        node.num_live_swa += delta
        self._num_swa += delta
        if node.swa_lock_ref == 0:
            self._evictable_swa += delta


def _as_key(tokens: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)


def _as_handle(node: object) -> _Handle:
    if not isinstance(node, _Handle):
        raise TypeError(f"expected the `node` of a PrefixMatch, got {type(node).__name__}")
    return node


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two 1-D int64 tensors."""
    n = min(a.numel(), b.numel())
    neq = torch.nonzero(a[:n] != b[:n])
    return int(neq[0]) if neq.numel() else n
