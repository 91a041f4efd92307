"""Scheduler: which sequences run this step with how many tokens, admission into both KV pools, preemption,
out-of-window SWA release, the prefix cache's lifecycle, and stop conditions.

One step: every running sequence gets its tokens first, oldest first (a decode needs 1 token, a prefill
continues with a chunk under the `max_prefill_tokens` budget); then waiting sequences are admitted in
policy order (`policy.order_waiting`) while the budget, `max_num_seqs` and both pools allow. When a pool
runs short, the prefix cache evicts first, then the newest running sequence is preempted (its slots freed,
it waits to be recomputed). The oldest running sequence therefore always progresses: no deadlock.

Prefix cache lifecycle (`radix.SwaRadixCache`). Admission matches the longest window-safe cached prefix of the
prompt (all but its last token), locks it and borrows its slots. After every prefill chunk the positions
computed so far go into the tree at once (SGLang's `cache_unfinished_req`), with the SWA of every one of them
still live, and the request goes on with the tree's slots under a lock at its new end. So a request with the
same prompt, or one that shares only a system prompt and branches anywhere inside it, reuses it as soon as
this one has computed it (while it still decodes, too), and the SWA the window needs at any branch point is in
the tree: no request has to guess where a later one will branch. What a request still owns is only what it
has not inserted yet: its decode positions. When it finishes (or is aborted) the rest goes in as before.

SWA stays O(window) per request: the tree holds the SWA of cached prompts, but only a lock's window is pinned;
the rest is evictable and goes before any running request is preempted. A request's lock pins the window
[L-W+1, L) at its insert point L (W-1 slots while it prefills); once its own queries have moved past it, the
lock keeps only the full path (`unlock_swa`). So it pins at most W-1 more than its own decode window, and only
for its first W-1 + swa_release_interval decode steps. Under SWA pressure the SWA that no insert or match
ended at goes first (inside prompts, chunk boundaries), then windows, least recently used first; a prompt's
end window (what a repeat of it matches) and a finished sequence's last window (what its next turn matches)
count as used. A preempted request's prompt stays cached (while memory allows): it resumes from the tree.
(`PrefixMatch.keep_swa` is for callers that insert only at the end; inserting every chunk keeps more.)
"""

from __future__ import annotations

import time

import torch

from engine_link.engine.config import EngineConfig, EngineModelConfig
from engine_link.engine.kv_pool import SlotAllocator
from engine_link.engine.policy import order_waiting
from engine_link.engine.radix import SwaRadixCache
from engine_link.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, model_cfg: EngineModelConfig, cfg: EngineConfig) -> None:
        self.cfg, self.window = cfg, model_cfg.sliding_window
        self.eos = frozenset(model_cfg.eos_token_id)
        self.full_pool = SlotAllocator(cfg.num_full_slots)
        self.swa_pool = SlotAllocator(cfg.swa_slots_for(model_cfg))
        self.radix = (SwaRadixCache(self.full_pool, self.swa_pool, self.window) if cfg.enable_prefix_cache
                      else None)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # admission order: oldest first
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens reused from the prefix cache (all admissions)

    # ------------------------------------------------------------------------------------------- requests
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_runnable(self) -> bool:
        """Whether a step can make progress: some request is not blocked on an embedding that has not arrived."""
        if any(seq.ready_end(seq.num_computed) > seq.num_computed for seq in self.running):
            return True
        starts = ((seq, len(seq) - self._uncached_estimate(seq)) for seq in self.waiting)  # after a cache hit
        return any(seq.ready_end(start) > start for seq, start in starts)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a waiting or running request with reason "abort"; None if it is not here."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._finish(seq, "abort")
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self._finish(seq, "abort")
                return seq
        return None

    # ------------------------------------------------------------------------------------------- schedule
    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of new positions to compute) for this step's forward."""
        budget = self.cfg.max_prefill_tokens
        scheduled: list[tuple[Sequence, int]] = []
        num_preempted = self.num_preemptions
        i = 0
        while i < len(self.running):  # NOTE: preemption pops from the end, never an already scheduled one
            seq = self.running[i]
            n = min(seq.ready_end(seq.num_computed) - seq.num_computed, budget if seq.is_prefill else 1)
            if n > 0 and self._reserve(seq, n):
                scheduled.append((seq, n))
                budget -= n if seq.is_prefill else 0
            if seq.status is Status.RUNNING:
                i += 1
        if self.num_preemptions > num_preempted:
            return scheduled  # NOTE: memory is short; admitting now would only be preempted again (thrash)
        for seq in self._ordered_waiting():
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            n = self._admit(seq, budget)
            if n < 0:
                continue  # waits for an embedding; does not hold up the others
            if n == 0:
                break  # NOTE: keep the policy order; the head waits for memory rather than being overtaken
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def _ordered_waiting(self) -> list[Sequence]:
        now = time.monotonic()
        return order_waiting(self.waiting, uncached_tokens=self._uncached_estimate,
                             waited_s=lambda s: now - s.arrival, policy=self.cfg.policy,
                             penalty_tokens_per_s=self.cfg.penalty_tokens_per_s)

    def _uncached_estimate(self, seq: Sequence) -> int:
        if self.radix is None or not seq.use_prefix_cache:
            return len(seq)
        return len(seq) - self.radix.match_length(seq.key_tokens()[:-1])  # NOTE: no side effects (every step)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Move `seq` to running with its prefix-cache match and first chunk; the chunk's length, 0 if the pools
        cannot take it, -1 if nothing is computable before an embedding arrives."""
        match = None
        if self.radix is not None and seq.use_prefix_cache:
            match = self.radix.match_prefix(seq.key_tokens()[:-1])  # NOTE: at least one token left to compute
            self.radix.lock(match.node)
        cached = match.length if match is not None else 0
        n = min(seq.ready_end(cached) - cached, budget)
        if n <= 0:
            if match is not None:
                self.radix.unlock(match.node)
            return -1
        if not self._can_hold(len(seq) - cached, n):
            if match is not None:
                self.radix.unlock(match.node)
            return 0
        got = self._alloc(n)
        if got is None:
            if match is not None:
                self.radix.unlock(match.node)
            return 0
        if match is not None:
            seq.radix_node = match.node
            seq.slots.borrow(match.full_slots, match.swa_slots)
        seq.slots.append(*got)
        seq.num_computed = seq.num_cached = cached
        self.num_cached_tokens += cached
        seq.status = Status.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        return n

    def _can_hold(self, num_full: int, num_swa: int) -> bool:
        """Whether both pools (free plus evictable prefix cache) hold a new request's tokens and first chunk."""
        free_full, free_swa = self.full_pool.num_free(), self.swa_pool.num_free()
        if self.radix is not None:
            free_full += self.radix.evictable_full()
            free_swa += self.radix.evictable_swa()
        return free_full >= num_full and free_swa >= num_swa

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Slots for `n` more positions of a running `seq`, preempting the newest sequences if needed."""
        while True:
            got = self._alloc(n)
            if got is not None:
                seq.slots.append(*got)
                return True
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                # NOTE: alone and still short: only its locked prefix-cache path can be in the way; recompute
                # without the cache so the next admission cannot lock it again (no livelock).
                seq.use_prefix_cache = False
            self._preempt(victim)
            if victim is seq:
                return False

    def _alloc(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """n slots in each pool, evicting from the prefix cache first; None (nothing taken) if short."""
        if self.radix is not None:
            short_full = max(0, n - self.full_pool.num_free())
            short_swa = max(0, n - self.swa_pool.num_free())
            if short_full or short_swa:
                self.radix.evict(short_full, short_swa)
        full = self.full_pool.alloc(n)
        swa = self.swa_pool.alloc(n) if full is not None else None
        if swa is None:
            if full is not None:
                self.full_pool.free(full)
            return None
        return full, swa

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, seq)

    def _release(self, seq: Sequence) -> None:
        """Give back every slot `seq` owns; unlock its prefix-cache path."""
        full, swa = seq.slots.owned()
        self.full_pool.free(full)
        self.swa_pool.free(swa)
        if seq.radix_node is not None:
            self.radix.unlock(seq.radix_node)
            seq.radix_node = None
        seq.slots.clear()

    # ------------------------------------------------------------------------------------------- after a step
    def postprocess(self, scheduled: list[tuple[Sequence, int]], sampled: list[int | None]) -> list[Sequence]:
        """Advance each sequence, append its sampled token, apply stop conditions, release out-of-window SWA.

        Returns:
            The sequences that got a new token this step (finished ones included).
        """
        updated = []
        for (seq, n), token in zip(scheduled, sampled, strict=True):
            if seq.status is not Status.RUNNING:
                continue  # aborted meanwhile
            was_prefill = seq.is_prefill
            seq.num_computed += n
            if token is not None:
                seq.output.append(token)
                if seq.first_token_at is None:
                    seq.first_token_at = time.monotonic()
                updated.append(seq)
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    self._finish(seq, reason)
                    continue
            seq.steps_since_release += 1
            if was_prefill and self.radix is not None and seq.use_prefix_cache:
                self._cache_computed(seq)
            if was_prefill or seq.steps_since_release >= self.cfg.swa_release_interval:
                self._release_out_of_window(seq)
        return updated

    def _cache_computed(self, seq: Sequence) -> None:
        """Hand the positions `seq` has computed to the prefix cache now (not only when it finishes), so requests
        with the same prefix reuse them meanwhile; `seq` goes on with the tree's slots under a lock at its end."""
        n, is_prompt_end = seq.num_computed, not seq.is_prefill
        key = seq.key_tokens()[:n]
        # NOTE: still under the old lock. Only the prompt's end window counts as recently used (a repeated prompt
        # reuses it); a chunk boundary's SWA ages out before the windows where prompts and sequences end.
        self.radix.insert(key, seq.slots.full[:n], seq.slots.swa[:n], recent=is_prompt_end)
        match = self.radix.match_prefix(key, recent=is_prompt_end)
        if match.length != n:  # its own window [n-W+1, n) went in live, so the whole prefix is window-safe
            raise RuntimeError(f"internal error: {n} positions inserted, {match.length} window-safe")
        self.radix.lock(match.node)
        if seq.radix_node is not None:
            self.radix.unlock(seq.radix_node)
        seq.radix_node = match.node
        seq.slots.borrow(match.full_slots, match.swa_slots)
        if is_prompt_end and n > 1:
            self.radix.match_prefix(key[:-1])  # NOTE: marks the window a repeat of this prompt matches [n-W, n-1)

    def _release_out_of_window(self, seq: Sequence) -> None:
        """Free SWA slots no future query reads: the next query at position p sees p-W+1..p. Once that is past
        the borrowed prefix, the prefix-cache lock stops pinning the SWA of its window."""
        self.swa_pool.free(seq.slots.release_swa_before(max(0, seq.num_computed - self.window + 1)))
        seq.steps_since_release = 0
        if seq.radix_node is not None and seq.slots.swa_released_upto >= seq.slots.num_borrowed:
            seq.radix_node = self.radix.unlock_swa(seq.radix_node)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (token in self.eos and not p.ignore_eos):
            return "stop"
        if len(seq.output) >= p.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Hand the sequence's KV to the prefix cache (which takes ownership) or back to the pools."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            if self.radix is not None and seq.use_prefix_cache:
                self._release_out_of_window(seq)
                n = seq.num_computed
                self.full_pool.free(seq.slots.full[n:])  # reserved for a step that never ran (abort)
                self.swa_pool.free(seq.slots.swa[n:])
                self.radix.insert(seq.key_tokens()[:n], seq.slots.full[:n], seq.slots.swa[:n])
                if seq.radix_node is not None:
                    self.radix.unlock(seq.radix_node)
                    seq.radix_node = None
                seq.slots.clear()
            else:
                self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    # ------------------------------------------------------------------------------------------- stats
    def usage(self) -> dict[str, int]:
        """Slots in use per pool, and how many of them the prefix cache holds."""
        stats = {"full_used": self.full_pool.num_used(), "swa_used": self.swa_pool.num_used(),
                 "full_cached": 0, "swa_cached": 0}
        if self.radix is not None:
            stats.update(full_cached=self.radix.cached_full(), swa_cached=self.radix.cached_swa())
        return stats
