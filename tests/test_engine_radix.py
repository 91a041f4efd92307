"""SwaRadixCache: window-safe matching, slot ownership, SWA tombstones, LRU eviction, and why naive matching is wrong.

The state machine runs requests against the cache the way the scheduler does (match -> lock -> alloc ->
release out-of-window SWA -> insert -> unlock, or abort) and checks the tree against a per-position
reference model after every step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_link.engine.kv_pool import SlotAllocator
from engine_link.engine.radix import SwaRadixCache, window_safe_length

Prefix = tuple[int, ...]


def dump(cache: SwaRadixCache) -> dict[Prefix, tuple[int, int]]:
    """Per cached position: token path up to and including it -> (full slot, SWA slot or -1)."""
    out = {}
    for view in cache.walk():
        start = len(view.path) - view.full.numel()
        for i, (f, s) in enumerate(zip(view.full.tolist(), view.swa.tolist(), strict=True)):
            out[tuple(view.path[:start + i + 1])] = (f, s)
    return out


def brute_safe_length(swa: list[int], window: int) -> int:
    for length in range(len(swa), -1, -1):
        if all(s >= 0 for s in swa[max(0, length - window + 1):length]):
            return length
    raise AssertionError("L = 0 is always safe")


@given(st.lists(st.sampled_from([-1, 0, 5]), max_size=30), st.integers(1, 8))
def test_window_safe_length_matches_brute_force(swa: list[int], window: int):
    assert window_safe_length(torch.tensor(swa, dtype=torch.int64), window) == brute_safe_length(swa, window)


def _cache(num_full: int = 64, num_swa: int = 64, window: int = 4) -> SwaRadixCache:
    return SwaRadixCache(SlotAllocator(num_full), SlotAllocator(num_swa), window)


def _request(cache: SwaRadixCache, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.full_pool.alloc(len(tokens)), cache.swa_pool.alloc(len(tokens))


def test_match_split_and_duplicates_freed():
    cache = _cache(window=4)
    a = list(range(10))
    full_a, swa_a = _request(cache, a)
    assert cache.insert(a, full_a, swa_a) == 0
    b = a[:6] + [99, 98]
    m = cache.match_prefix(b)
    assert (m.length, m.naive_length) == (6, 6)
    assert torch.equal(m.full_slots, full_a[:6])
    assert m.swa_slots.tolist() == [-1, -1, -1] + swa_a[3:6].tolist()  # only the window [L-W+1, L) is handed out
    cache.lock(m.node)
    full_b = torch.cat([m.full_slots, cache.full_pool.alloc(2)])
    swa_b = torch.cat([m.swa_slots, cache.swa_pool.alloc(2)])
    assert cache.insert(b, full_b, swa_b) == 6  # the tree's own slots come back: nothing freed twice
    cache.unlock(m.node)
    assert cache.cached_full() == 12 and cache.full_pool.num_free() == 64 - 12
    # a request that did not use the cache: its 10 duplicate slots per pool are freed by insert
    full_c, swa_c = _request(cache, a)
    assert cache.insert(a, full_c, swa_c) == 10
    assert cache.full_pool.num_free() == 64 - 12 and cache.swa_pool.num_free() == 64 - 12
    assert dump(cache)[tuple(a)] == (int(full_a[-1]), int(swa_a[-1]))
    with pytest.raises(ValueError, match="not free"):
        cache.insert([5, 5], full_c[:2], torch.tensor([-1, -1]))  # freed above: not the caller's to give


def test_released_swa_limits_the_match_and_insert_refills_it():
    window = 4
    cache = _cache(window=window)
    a = list(range(12))
    full_a, swa_a = _request(cache, a)
    cache.swa_pool.free(swa_a[:12 - window + 1])  # the request released out-of-window SWA (keeps the last W-1)
    swa_a[:12 - window + 1] = -1
    cache.insert(a, full_a, swa_a)
    assert cache.match_prefix(a).length == 12  # the end is window safe
    m = cache.match_prefix(a[:8] + [50])
    assert (m.length, m.naive_length) == (0, 8)  # positions 5..7 have no SWA: miss
    assert cache.match_length(a[:8] + [50]) == 0 and cache.naive_match_length(a[:8]) == 8
    # a request recomputed a[:8]; its insert fills the tree's dead SWA with its live slots
    full_b, swa_b = _request(cache, a[:8])
    cache.swa_pool.free(swa_b[:8 - window + 1])
    swa_b[:8 - window + 1] = -1
    cache.insert(a[:8], full_b, swa_b)
    m = cache.match_prefix(a[:8] + [50])
    assert m.length == 8 and torch.equal(m.swa_slots[5:], swa_b[5:]) and torch.equal(m.full_slots, full_a[:8])
    assert cache.full_pool.num_free() == 64 - 12  # the recomputed full slots were duplicates: freed


def test_keep_swa_makes_a_shared_prefix_reusable():
    """Two sessions share a system prompt. The first released the prompt's SWA, so the second's match is trimmed
    to 0; if it keeps `keep_swa` (the window where it leaves the tree) until insert, the third gets a hit."""
    window = 4
    cache = _cache(window=window)
    system = list(range(10))
    first = system + [100, 101, 102]
    full, swa = _request(cache, first)
    cache.swa_pool.free(swa[:13 - window + 1])
    swa[:13 - window + 1] = -1
    cache.insert(first, full, swa)
    second = system + [200, 201, 202]
    m = cache.match_prefix(second)
    assert (m.length, m.naive_length, m.keep_swa) == (0, 10, (7, 10))
    full, swa = _request(cache, second)
    released = torch.ones(13, dtype=torch.bool)
    released[13 - window + 1:] = False
    released[7:10] = False  # kept: the branch-point window
    cache.swa_pool.free(swa[released])
    swa[released] = -1
    cache.insert(second, full, swa)
    m = cache.match_prefix(system + [300])
    assert (m.length, m.naive_length, m.keep_swa) == (10, 10, (0, 0))


def test_swa_eviction_drops_a_leaf_whole():
    window = 3
    cache = _cache(window=window)
    sys_prompt, turn = list(range(20)), [100, 101, 102, 103]
    full_s, swa_s = _request(cache, sys_prompt)
    cache.insert(sys_prompt, full_s, swa_s)
    seq = sys_prompt + turn
    full_t, swa_t = _request(cache, turn)
    cache.insert(seq, torch.cat([full_s, full_t]), torch.cat([swa_s, swa_t]))
    cache.match_prefix(sys_prompt + [7])  # the system prompt's window [18, 20) is the most recently used SWA
    # SWA outside every window where an insert or match ended goes first ([0, 18), then [20, 22)); internal
    # nodes keep their full slots, and the prefixes stay reusable
    assert cache.evict(0, 1) == (0, 18) and cache.evict(0, 1) == (0, 2)
    assert cache.match_prefix(sys_prompt + [7]).length == 20
    assert cache.evict(0, 1) == (4, 2)  # least recent window: the turn's leaf; without SWA the turn is useless
    assert cache.match_prefix(seq).length == 20
    assert cache.evict(0, 1) == (20, 2)  # now the window is a leaf, and its SWA-less parent goes with it
    assert cache.cached_full() == 0 and cache.full_pool.num_free() == 64 and cache.swa_pool.num_free() == 64


def test_multi_turn_old_swa_evicted_full_kept():
    """Turn 2 extends turn 1; turn 1's SWA is needed by no later match, so it ages out first while its full
    slots stay, and turn 3 still reuses all of turn 2."""
    window = 3
    cache = _cache(window=window)
    turn1, turn2 = list(range(10)), list(range(10)) + [50, 51, 52, 53, 54]
    full1, swa1 = _request(cache, turn1)
    cache.insert(turn1, full1, swa1)
    m = cache.match_prefix(turn2[:-1])
    assert m.length == 10
    cache.lock(m.node)
    full_new, swa_new = _request(cache, turn2[10:])
    cache.insert(turn2, torch.cat([m.full_slots, full_new]), torch.cat([m.swa_slots, swa_new]))
    cache.unlock(m.node)
    assert cache.match_prefix(turn2 + [60]).length == 15
    # the SWA outside windows ([0, 8) and [10, 13)) goes first, then turn 1's window [8, 10): internal, tombstoned
    assert cache.evict(0, 13) == (0, 13)
    m = cache.match_prefix(turn2 + [60])
    assert m.length == 15 and torch.equal(m.full_slots, torch.cat([full1, full_new]))
    assert cache.match_prefix(turn1 + [70]).length == 0 and cache.naive_match_length(turn1 + [70]) == 10


def test_lock_protects_full_path_and_only_the_window_swa():
    window = 3
    cache = _cache(window=window)
    seq = list(range(10))
    full, swa = _request(cache, seq)
    cache.insert(seq[:6], full[:6], swa[:6])
    cache.insert(seq, full, swa)  # nodes [0, 6) and [6, 10)
    m = cache.match_prefix(seq)  # cuts [6, 10) at the window start 8
    cache.lock(m.node)
    assert (cache.evictable_full(), cache.evictable_swa()) == (0, 8)
    assert cache.evict(100, 100) == (0, 8)  # [0, 6) and [6, 8) lie outside the window [8, 10): their SWA goes
    assert cache.match_prefix(seq).length == 10
    cache.unlock(m.node)
    assert (cache.evictable_full(), cache.evictable_swa()) == (10, 2)
    with pytest.raises(TypeError):
        cache.lock(object())


def test_split_of_a_locked_node_moves_swa_locks_by_window():
    window = 3
    cache = _cache(window=window)
    seq = list(range(10))
    full, swa = _request(cache, seq)
    cache.insert(seq, full, swa)
    m = cache.match_prefix(seq)  # cuts at the window start: [0, 8) and [8, 10)
    cache.lock(m.node)  # window [8, 10)
    views = {len(v.path): v for v in cache.walk()}
    assert views[8].is_locked and not views[8].is_swa_locked and views[10].is_swa_locked
    assert (cache.evictable_full(), cache.evictable_swa()) == (0, 8)
    f, s = _request(cache, [50, 51])
    cache.insert(seq[:4] + [50, 51], torch.cat([cache.full_pool.alloc(4), f]), torch.cat([swa[:4] * 0 - 1, s]))
    # cut at 4, before the window: both parts are full-locked, their SWA is evictable
    views = {len(v.path): v for v in cache.walk()}
    assert views[4].is_locked and not views[4].is_swa_locked and not views[8].is_swa_locked
    assert (cache.evictable_full(), cache.evictable_swa()) == (2, 8 + 2)
    f, s = _request(cache, [60])
    cache.insert(seq[:9] + [60], torch.cat([full[:9], f]), torch.cat([torch.full((9,), -1), s]))
    views = {len(v.path): v for v in cache.walk()}
    assert views[9].is_swa_locked and views[10].is_swa_locked  # cut at 9, inside the window: both parts
    assert cache.evict(0, 100) == (3, 8 + 3)  # the two new leaves go whole, [0, 8) loses its SWA
    assert cache.match_prefix(seq).length == 10
    cache.unlock(m.node)
    assert (cache.evictable_full(), cache.evictable_swa()) == (10, 2)
    assert sorted(cache.full_pool.free_slots().tolist() + full.tolist()) == list(range(64))


def test_unlock_without_lock_refused():
    cache = _cache()
    full, swa = _request(cache, [1, 2, 3])
    cache.insert([1, 2, 3], full, swa)
    m = cache.match_prefix([1, 2, 3])
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(m.node)


def test_naive_equal_tokens_rule_is_wrong():
    """After its SWA is released, a cached prefix still matches token for token, but the SWA slots the naive
    rule would read for its last W-1 positions are free or already hold another request's KV."""
    window = 4
    cache = _cache(num_full=64, num_swa=24, window=window)
    agent = list(range(12))
    full_a, swa_a = _request(cache, agent)
    naive_swa = swa_a.clone()  # what a naive tree records: the slots the request had at insert time
    released = swa_a[:12 - window + 1]
    cache.swa_pool.free(released)  # out-of-window release while the request ran
    swa_a[:12 - window + 1] = -1
    cache.insert(agent, full_a, swa_a)
    other = cache.swa_pool.alloc(cache.swa_pool.num_free())  # another request takes every free SWA slot
    probe = agent[:7] + [500]
    naive = cache.naive_match_length(probe)
    m = cache.match_prefix(probe)
    assert naive == 7 and m.length == 0 < naive
    need = naive_swa[naive - window + 1:naive]  # the SWA keys token `naive` would attend to
    assert set(need.tolist()) <= set(other.tolist())  # owned by the other request: wrong outputs
    # SWA eviction: the same with slots the tree itself gave up. Turn 2 extends turn 1; turn 1's SWA ages out.
    cache.swa_pool.free(other)
    turn1, turn2 = list(range(200, 210)), list(range(200, 210)) + [300, 301, 302, 303, 304]
    full1, swa1 = _request(cache, turn1)
    cache.insert(turn1, full1, swa1)
    m = cache.match_prefix(turn2[:-1])
    cache.lock(m.node)
    full2, swa2 = _request(cache, turn2[10:])
    cache.insert(turn2, torch.cat([m.full_slots, full2]), torch.cat([m.swa_slots, swa2]))
    cache.unlock(m.node)
    cache.match_prefix(turn2 + [1])
    cache.evict(0, cache.cached_swa() - (window - 1))  # all but the latest window [12, 15) ages out
    probe = turn1 + [9]
    assert cache.naive_match_length(probe) == 10 and cache.match_prefix(probe).length == 0
    assert bool(cache.swa_pool.is_free(swa1[10 - window + 1:]).all())  # what the naive rule would read
    assert cache.match_prefix(turn2 + [1]).length == 15  # full slots kept: the long prefix is still reusable


def test_prefix_bench_smoke(tmp_path):
    """The prefix-cache benchmark on a small trace: window-safe <= naive, the naive rule has unsafe hits, keeping
    the branch-point window does not lose hits, and every slot is accounted for (asserted inside the sim)."""
    import json

    from bench.engine_prefix import main

    argv = ["--sessions", "10", "--live-sessions", "4", "--turns", "3", "--system-tokens", "256",
            "--user-tokens", "16,64", "--output-tokens", "8,32", "--window", "32", "--chunk", "64",
            "--full-slots", "2048", "--swa-slots", "256,2048", "--headline-swa", "256", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "engine_prefix.json").read_text())["rows"]
    cached = [r for r in rows if r["config"] != "no cache"]
    assert all(r["hit_rate"] <= r["naive_hit_rate"] and r["failed"] == 0 for r in rows)
    assert any(r["unsafe_hits"] > 0 for r in cached)
    by = {(r["swa_slots"], r["keep_branch"]): r for r in cached}
    assert by[(None, True)]["hit_rate"] >= by[(None, False)]["hit_rate"] > 0
    assert rows[-1]["hit_rate"] == 0 and rows[-1]["prefill_tokens"] == rows[-1]["prompt_tokens"]


class RadixMachine(RuleBasedStateMachine):
    """Requests against the cache; the tree must equal the reference model after every step."""

    W, NUM_FULL, NUM_SWA = 3, 40, 16

    def __init__(self) -> None:
        super().__init__()
        self.cache = SwaRadixCache(SlotAllocator(self.NUM_FULL), SlotAllocator(self.NUM_SWA), self.W)
        self.model: dict[Prefix, tuple[int, int]] = {}
        self.reqs: list[dict] = []
        self.history: list[list[int]] = []  # finished sequences: the next turn of a session extends one

    # ------------------------------------------------------------------ reference checks

    def _check_match(self, tokens: list[int], m) -> None:
        naive = 0
        while naive < len(tokens) and tuple(tokens[:naive + 1]) in self.model:
            naive += 1
        cells = [self.model[tuple(tokens[:i + 1])] for i in range(naive)]
        swa = [s for _, s in cells]
        assert m.naive_length == naive
        assert m.length == brute_safe_length(swa, self.W)  # never past the window-safe length, and not shorter
        assert (m.swa_slots[max(0, m.length - self.W + 1):] >= 0).all()
        lo = max(0, m.length - self.W + 1)
        assert m.full_slots.tolist() == [f for f, _ in cells[:m.length]]
        assert m.swa_slots.tolist() == [-1] * lo + swa[lo:m.length]  # the window, exactly as inserted

    def _locked(self) -> set[Prefix]:
        """Positions (as prefixes) on locked paths: their full slots must stay."""
        return {tuple(r["tokens"][:i]) for r in self.reqs for i in range(1, r["match_len"] + 1)}

    def _windows(self) -> set[Prefix]:
        """Positions in a lock's window [L-W+1, L): their SWA slots must stay (unless `unlock_swa` dropped it)."""
        return {tuple(r["tokens"][:i + 1]) for r in self.reqs if r["swa_locked"]
                for i in range(max(0, r["match_len"] - self.W + 1), r["match_len"])}

    def _evict(self, num_full: int, num_swa: int) -> tuple[int, int]:
        before, locked, windows = dump(self.cache), self._locked(), self._windows()
        can_full, can_swa = self.cache.evictable_full(), self.cache.evictable_swa()
        freed_full, freed_swa = self.cache.evict(num_full, num_swa)
        after = dump(self.cache)
        assert set(after) <= set(before)
        assert all(after[p][0] == before[p][0] and after[p][1] in (before[p][1], -1) for p in after)
        assert all(p in after and after[p][0] == before[p][0] for p in locked)  # locked paths keep full
        assert all(after[p] == before[p] for p in windows)  # and their windows keep SWA
        assert freed_full == len(before) - len(after) and freed_full >= min(num_full, can_full)
        live = sum(s >= 0 for _, s in before.values()) - sum(s >= 0 for _, s in after.values())
        assert freed_swa == live and freed_swa >= min(num_swa, can_swa)
        self.model = after
        return freed_full, freed_swa

    def _alloc(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        short_full = max(0, n - self.cache.full_pool.num_free())
        short_swa = max(0, n - self.cache.swa_pool.num_free())
        if short_full or short_swa:
            self._evict(short_full, short_swa)
        full, swa = self.cache.full_pool.alloc(n), self.cache.swa_pool.alloc(n)
        if full is None or swa is None:
            self.cache.full_pool.free(full if full is not None else torch.empty(0, dtype=torch.int64))
            self.cache.swa_pool.free(swa if swa is not None else torch.empty(0, dtype=torch.int64))
            return None
        return full, swa

    # ------------------------------------------------------------------ rules

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=10), use_cache=st.booleans())
    def start_request(self, tokens: list[int], use_cache: bool) -> None:
        node, length, keep = None, 0, (0, 0)
        full = swa = torch.empty(0, dtype=torch.int64)
        if use_cache:
            m = self.cache.match_prefix(tokens)
            self._check_match(tokens, m)
            self.cache.lock(m.node)
            node, length, full, swa, keep = m.node, m.length, m.full_slots, m.swa_slots, m.keep_swa
            assert keep == (0, 0) or length <= keep[0] < keep[1] == m.naive_length <= keep[0] + self.W - 1
        new = self._alloc(len(tokens) - length)
        if new is None:
            if node is not None:
                self.cache.unlock(node)
            return
        self.reqs.append({"tokens": tokens, "match_len": length, "node": node, "keep": keep, "swa_locked": True,
                          "full": torch.cat([full, new[0]]), "swa": torch.cat([swa, new[1]])})

    @precondition(lambda self: self.history)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def start_next_turn(self, data: st.DataObject, extra: list[int]) -> None:
        """A session's next turn: an earlier sequence plus new tokens (multi-turn agent traffic)."""
        self.start_request(data.draw(st.sampled_from(self.history))[:14] + extra, True)

    @rule(num_swa=st.integers(1, 8))
    def evict_swa(self, num_swa: int) -> None:
        self._evict(0, num_swa)

    @rule(tokens=st.lists(st.integers(0, 2), max_size=10))
    def probe(self, tokens: list[int]) -> None:
        self._check_match(tokens, self.cache.match_prefix(tokens))
        assert self.cache.naive_match_length(tokens) == self.cache.match_prefix(tokens).naive_length

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def release_window(self, data: st.DataObject) -> None:
        self._release(data.draw(st.sampled_from(self.reqs)))

    def _release(self, r: dict) -> None:
        """Out-of-window SWA release, as the scheduler does after prefill chunks and decode steps."""
        forget = torch.arange(len(r["tokens"])) < len(r["tokens"]) - self.W + 1
        forget[r["keep"][0]:r["keep"][1]] = False  # the branch-point window goes to the tree at insert
        own = r["swa"][r["match_len"]:][forget[r["match_len"]:]]
        self.cache.swa_pool.free(own)  # only its own slots; tree-owned ones are just forgotten
        r["swa"][forget] = -1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cache_computed(self, data: st.DataObject) -> None:
        """As the scheduler after a prefill chunk: insert what the request computed, then use the tree's copy
        under a new lock (taken before the old one is dropped)."""
        r = data.draw(st.sampled_from(self.reqs))
        self._insert(r)
        m = self.cache.match_prefix(r["tokens"])
        assert m.length == len(r["tokens"])  # its own window went in live
        self.cache.lock(m.node)
        if r["node"] is not None:
            self.cache.unlock(r["node"])
        r.update(node=m.node, match_len=m.length, keep=(0, 0), swa_locked=True, full=m.full_slots, swa=m.swa_slots)

    def _past_window(self) -> list[dict]:
        """Requests with a lock whose own positions cover their whole last window (as in the scheduler)."""
        return [r for r in self.reqs if r["node"] is not None and len(r["tokens"]) - self.W + 1 >= r["match_len"]]

    @precondition(lambda self: self._past_window())
    @rule(data=st.data())
    def unlock_swa(self, data: st.DataObject) -> None:
        """A request whose queries moved past its match's window keeps only the full path locked."""
        r = data.draw(st.sampled_from(self._past_window()))
        r["node"] = self.cache.unlock_swa(r["node"])
        r["swa_locked"] = False
        r["swa"][:r["match_len"]] = -1  # it reads none of the tree's SWA any more

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), release=st.booleans())
    def finish(self, data: st.DataObject, release: bool) -> None:
        r = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        if release:
            self._release(r)
        self._insert(r)
        self.history.append(r["tokens"])
        if r["node"] is not None:
            self.cache.unlock(r["node"])

    def _insert(self, r: dict) -> None:
        tokens, full, swa = r["tokens"], r["full"].tolist(), r["swa"].tolist()
        existing = 0
        for i in range(len(tokens)):
            p = tuple(tokens[:i + 1])
            if p in self.model:
                existing += 1
                tree_full, tree_swa = self.model[p]
                if tree_swa < 0 and swa[i] >= 0:
                    self.model[p] = (tree_full, swa[i])
            else:
                self.model[p] = (full[i], swa[i])
        assert self.cache.insert(tokens, r["full"], r["swa"]) == existing

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        r = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        self.cache.full_pool.free(r["full"][r["match_len"]:])
        self.cache.swa_pool.free(r["swa"][r["match_len"]:])
        if r["node"] is not None:
            self.cache.unlock(r["node"])

    @rule(num_full=st.integers(0, 12), num_swa=st.integers(0, 12))
    def evict(self, num_full: int, num_swa: int) -> None:
        self._evict(num_full, num_swa)

    @rule()
    def evict_everything(self) -> None:
        can = (self.cache.evictable_full(), self.cache.evictable_swa())
        assert self._evict(10**6, 10**6) == can  # evictable_* is exactly what evict can free
        assert set(self.model) == self._locked()
        assert (self.cache.evictable_full(), self.cache.evictable_swa()) == (0, 0)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tree_equals_model(self) -> None:
        assert dump(self.cache) == self.model

    @invariant()
    def slots_partition(self) -> None:
        tree_full = [f for f, _ in self.model.values()]
        tree_swa = [s for _, s in self.model.values() if s >= 0]
        req_full = [f for r in self.reqs for f in r["full"][r["match_len"]:].tolist()]
        req_swa = [s for r in self.reqs for s in r["swa"][r["match_len"]:].tolist() if s >= 0]
        free_full = self.cache.full_pool.free_slots().tolist()
        free_swa = self.cache.swa_pool.free_slots().tolist()
        assert sorted(tree_full + req_full + free_full) == list(range(self.NUM_FULL))
        assert sorted(tree_swa + req_swa + free_swa) == list(range(self.NUM_SWA))

    @invariant()
    def counters(self) -> None:
        locked, views = self._locked(), list(self.cache.walk())
        assert self.cache.evictable_full() == sum(p not in locked for p in self.model)
        assert self.cache.evictable_swa() == sum(int((v.swa >= 0).sum()) for v in views if not v.is_swa_locked)
        assert self.cache.cached_full() == len(self.model)
        assert self.cache.cached_swa() == sum(s >= 0 for _, s in self.model.values())
        for v in views:
            end = len(v.path)
            assert v.is_locked == (tuple(v.path) in locked)
            assert v.is_swa_locked == any(
                r["node"] is not None and r["swa_locked"] and r["match_len"] >= end and r["tokens"][:end] == v.path
                and end > r["match_len"] - self.W + 1 for r in self.reqs)


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
