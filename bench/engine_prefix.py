"""Prefix-cache benchmark of the engine (issue 6, section 6): effective hit length on a multi-turn agent trace.

CPU only; no model. The engine's KV bookkeeping is simulated on the real `SlotAllocator` pools and the
real `SwaRadixCache`, exactly as the scheduler drives them: match `prompt[:-1]`, lock, prefill in chunks
(allocating full + SWA slots per chunk and releasing out-of-window SWA after each), decode the output,
then insert prompt + output (minus the last sampled token, which has no KV yet) and unlock. When a pool
runs short the cache evicts (LRU); if that is not enough, the oldest running request finishes first.

Trace (seeded): sessions share one of a few system prompts; turn k of a session is the whole previous
turn (prompt + output) plus a new user message, so prefixes grow. A fixed number of sessions is live at
a time and their turns interleave at random, so the cache is under pressure from the other sessions.

Compared on the same trace:
- window-safe: our SWA-aware cache; a match is reused only up to the window-safe length.
- naive: the "equal tokens" rule, read off the same matches (`PrefixMatch.naive_length`). Every token it
  claims beyond the window-safe length would attend to SWA KV that was released or evicted (freed, maybe
  reused by another request): "unsafe" hits give wrong outputs.
- no cache: every prompt token is prefilled.
- unbounded: the window-safe cache with pools that never run short (the ceiling for this trace).
Rows sweep the SWA pool size at a fixed full pool: SWA needs O(window) per request, not O(sequence).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import markdown_table, write_results
from engine_link.engine.kv_pool import SlotAllocator
from engine_link.engine.radix import SwaRadixCache

_NONE = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class TraceConfig:
    """Synthetic multi-turn agent workload."""

    sessions: int = 96
    live_sessions: int = 24
    turns: int = 6
    system_prompts: int = 4
    system_tokens: int = 1024
    user_tokens: tuple[int, int] = (32, 512)  # uniform, inclusive
    output_tokens: tuple[int, int] = (16, 256)
    vocab: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.sessions, self.live_sessions, self.turns, self.system_prompts) < 1:
            raise ValueError("sessions, live_sessions, turns and system_prompts must be >= 1")
        for lo, hi in (self.user_tokens, self.output_tokens):
            if not 1 <= lo <= hi:
                raise ValueError("token ranges need 1 <= low <= high")


@dataclass
class Request:
    session: int
    prompt: list[int]
    output: list[int]

    @property
    def computed(self) -> list[int]:
        """Positions whose KV exists when the request finishes (the last sampled token has none yet)."""
        return self.prompt + self.output[:-1]


def make_trace(cfg: TraceConfig) -> list[Request]:
    """Requests in arrival order; a session's turns arrive in order, sessions interleave at random."""
    rng = random.Random(cfg.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(cfg.vocab) for _ in range(n)]

    systems = [tokens(cfg.system_tokens) for _ in range(cfg.system_prompts)]
    history: dict[int, list[int]] = {}
    turns_left: dict[int, int] = {}
    next_session, out = 0, []
    while next_session < cfg.sessions or turns_left:
        while len(turns_left) < cfg.live_sessions and next_session < cfg.sessions:
            history[next_session] = list(rng.choice(systems))
            turns_left[next_session] = cfg.turns
            next_session += 1
        s = rng.choice(sorted(turns_left))
        prompt = history[s] + tokens(rng.randint(*cfg.user_tokens))
        req = Request(s, prompt, tokens(rng.randint(*cfg.output_tokens)))
        out.append(req)
        history[s] = prompt + req.output
        turns_left[s] -= 1
        if not turns_left[s]:
            del turns_left[s], history[s]
    return out


@dataclass
class _Running:
    req: Request
    handle: object | None
    borrowed: int  # positions whose slots belong to the tree
    keep: tuple[int, int] = (0, 0)  # own SWA positions kept past the window (the branch point's window)
    full: list[torch.Tensor] = field(default_factory=list)
    swa: list[torch.Tensor] = field(default_factory=list)


class EngineSim:
    """The scheduler's slot lifecycle on real pools and the real radix cache (no model)."""

    def __init__(self, full_slots: int, swa_slots: int, window: int, chunk: int, max_running: int,
                 use_cache: bool, keep_branch: bool = False) -> None:
        self.full_pool, self.swa_pool = SlotAllocator(full_slots), SlotAllocator(swa_slots)
        self.cache = SwaRadixCache(self.full_pool, self.swa_pool, window) if use_cache else None
        self.window, self.chunk, self.max_running = window, chunk, max_running
        self.keep_branch = keep_branch
        self.running: deque[_Running] = deque()
        self.stats: dict[str, float] = dict(requests=0, prompt_tokens=0, reused=0, naive_claimed=0, unsafe_hits=0,
                                            unsafe_tokens=0, hits=0, failed=0, evictions=0)
        self.samples: list[tuple[int, int, int, int]] = []  # (full used, swa used, tree full, tree live swa)

    def run(self, trace: list[Request]) -> dict[str, float]:
        for req in trace:
            for r in list(self.running):  # the user's next turn comes after the previous answer
                if r.req.session == req.session:
                    self._finish_through(r)
            self._admit(req)
            while len(self.running) > self.max_running:
                self._finish(self.running.popleft())
        while self.running:
            self._finish(self.running.popleft())
        # NOTE: with nothing running, every slot is free or owned by the tree (a leak or double free fails here)
        tree = (self.cache.cached_full(), self.cache.cached_swa()) if self.cache else (0, 0)
        assert self.full_pool.num_free() + tree[0] == self.full_pool.num_slots
        assert self.swa_pool.num_free() + tree[1] == self.swa_pool.num_slots
        return self._report()

    def _admit(self, req: Request) -> None:
        st = self.stats
        st["requests"] += 1
        st["prompt_tokens"] += len(req.prompt)
        r = _Running(req, None, 0)
        if self.cache is not None:
            m = self.cache.match_prefix(req.prompt[:-1])
            self.cache.lock(m.node)
            r.handle, r.borrowed = m.node, m.length
            r.full.append(m.full_slots)
            r.swa.append(m.swa_slots)
            st["reused"] += m.length
            st["hits"] += m.length > 0
            st["naive_claimed"] += m.naive_length
            st["unsafe_hits"] += m.naive_length > m.length
            st["unsafe_tokens"] += m.naive_length - m.length
            if self.keep_branch:  # the window where the request leaves the tree, when the tree lacks it
                r.keep = m.keep_swa
        total, pos = len(req.computed), r.borrowed
        while pos < total:  # chunked prefill, then the decode steps as one more chunk
            n = min(self.chunk, total - pos) if pos < len(req.prompt) else total - pos
            slots = self._alloc(n)
            if slots is None:
                st["failed"] += 1
                self._release(r, _NONE if not r.full else torch.cat(r.full)[r.borrowed:])
                return
            r.full.append(slots[0])
            r.swa.append(slots[1])
            pos += n
            self._release_out_of_window(r, pos)
        self.running.append(r)
        tree = (self.cache.cached_full(), self.cache.cached_swa()) if self.cache else (0, 0)
        self.samples.append((self.full_pool.num_used(), self.swa_pool.num_used(), *tree))

    def _alloc(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        while True:
            short_full = max(0, n - self.full_pool.num_free())
            short_swa = max(0, n - self.swa_pool.num_free())
            if not short_full and not short_swa:
                return self.full_pool.alloc(n), self.swa_pool.alloc(n)
            if self.cache is not None and (self.cache.evictable_full() if short_full else self.cache.evictable_swa()):
                self.cache.evict(short_full, short_swa)
                self.stats["evictions"] += 1
            elif self.running:
                self._finish(self.running.popleft())
            else:
                return None

    def _release_out_of_window(self, r: _Running, pos: int) -> None:
        """Free the request's own SWA slots no future query reads (positions < pos-W+1); forget borrowed ones."""
        swa = torch.cat(r.swa)  # [pos]
        cut = max(0, pos - self.window + 1)
        forget = torch.arange(swa.numel()) < cut  # [pos]
        forget[r.keep[0]:r.keep[1]] = False
        self.swa_pool.free(swa[r.borrowed:][forget[r.borrowed:]])
        swa[forget] = -1
        r.swa = [swa]

    def _finish_through(self, target: _Running) -> None:
        while self.running:
            r = self.running.popleft()
            self._finish(r)
            if r is target:
                return

    def _finish(self, r: _Running) -> None:
        full, swa = torch.cat(r.full), torch.cat(r.swa)
        if self.cache is None:
            self._release(r, full)
            return
        self.cache.insert(r.req.computed, full, swa)
        self.cache.unlock(r.handle)

    def _release(self, r: _Running, own_full: torch.Tensor) -> None:
        self.full_pool.free(own_full)
        swa = torch.cat(r.swa) if r.swa else _NONE
        self.swa_pool.free(swa[r.borrowed:])
        if r.handle is not None:
            self.cache.unlock(r.handle)

    def _report(self) -> dict[str, float]:
        st = dict(self.stats)
        prompt = max(1, st["prompt_tokens"])
        st["hit_rate"] = st["reused"] / prompt
        st["naive_hit_rate"] = st["naive_claimed"] / prompt
        st["unsafe_frac_of_naive"] = st["unsafe_tokens"] / max(1, st["naive_claimed"])
        st["prefill_tokens"] = st["prompt_tokens"] - st["reused"]
        cols = list(zip(*self.samples, strict=True)) if self.samples else [(0,)] * 4
        for name, values in zip(("full_used", "swa_used", "tree_full", "tree_swa"), cols, strict=True):
            st[f"{name}_mean"] = sum(values) / len(values)
            st[f"{name}_peak"] = max(values)
        st["swa_per_full_used"] = st["swa_used_mean"] / max(1.0, st["full_used_mean"])
        return st


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmenc bench engine-prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TraceConfig()
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--live-sessions", type=int, default=d.live_sessions, help="sessions interleaved at a time")
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--system-prompts", type=int, default=d.system_prompts)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--user-tokens", default=f"{d.user_tokens[0]},{d.user_tokens[1]}", help="low,high")
    p.add_argument("--output-tokens", default=f"{d.output_tokens[0]},{d.output_tokens[1]}", help="low,high")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--window", type=int, default=128, help="sliding window W (counts the query)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--full-slots", type=int, default=49152, help="full-attention pool (token slots)")
    p.add_argument("--swa-slots", default="2048,4096,8192,49152", help="SWA pool sizes to sweep")
    p.add_argument("--headline-swa", type=int, default=8192, help="SWA pool of the SUMMARY line")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--name", default="engine_prefix")
    a = p.parse_args(argv)
    try:
        cfg = TraceConfig(a.sessions, a.live_sessions, a.turns, a.system_prompts, a.system_tokens,
                          tuple(_ints(a.user_tokens)), tuple(_ints(a.output_tokens)), seed=a.seed)
    except (ValueError, TypeError) as e:
        p.error(str(e))
    if a.window < 1 or a.chunk < 1 or a.max_running < 1:
        p.error("--window, --chunk and --max-running must be >= 1")
    swa_sizes = sorted(set(_ints(a.swa_slots)) | {a.headline_swa})

    start = time.perf_counter()
    trace = make_trace(cfg)
    longest = max(len(r.computed) for r in trace)
    if a.full_slots < longest + a.chunk or min(swa_sizes) < a.window + a.chunk:
        p.error(f"pools too small: full needs >= {longest + a.chunk}, SWA >= {a.window + a.chunk}")
    sim = dict(window=a.window, chunk=a.chunk, max_running=a.max_running)
    unbounded = sum(len(r.computed) for r in trace)  # every position of every request: never short
    rows = []
    for swa_slots in swa_sizes:
        for keep in (False, True):
            rows.append({"config": f"window-safe, {'keep branch' if keep else 'release'}, SWA {swa_slots}",
                         "full_slots": a.full_slots, "swa_slots": swa_slots, "keep_branch": keep,
                         **EngineSim(a.full_slots, swa_slots, use_cache=True, keep_branch=keep, **sim).run(trace)})
    for keep in (False, True):
        rows.append({"config": f"window-safe, {'keep branch' if keep else 'release'}, unbounded pools",
                     "full_slots": None, "swa_slots": None, "keep_branch": keep,
                     **EngineSim(unbounded, unbounded, use_cache=True, keep_branch=keep, **sim).run(trace)})
    rows.append({"config": "no cache", "full_slots": a.full_slots, "swa_slots": max(swa_sizes), "keep_branch": False,
                 **EngineSim(a.full_slots, max(swa_sizes), use_cache=False, **sim).run(trace)})
    sim_s = time.perf_counter() - start

    def row(swa: int, keep: bool) -> dict[str, Any]:
        return next(r for r in rows if r["swa_slots"] == swa and r["keep_branch"] == keep)

    head, head_keep, big, big_keep = row(a.headline_swa, False), row(a.headline_swa, True), \
        row(max(swa_sizes), False), row(max(swa_sizes), True)
    no_cache = rows[-1]
    payload = {"bench": "engine_prefix", "trace": {**cfg.__dict__, "requests": len(trace), "longest": longest,
                                                   "prompt_tokens": head["prompt_tokens"]},
               "window": a.window, "chunk": a.chunk, "max_running": a.max_running, "headline_swa": a.headline_swa,
               "rows": rows, "sim_seconds": sim_s,
               "env": {"python": platform.python_version(), "torch": torch.__version__,
                       "cpu_count": os.cpu_count(), "machine": platform.machine()},
               "argv": argv if argv is not None else sys.argv[1:]}
    path = write_results(a.name, a.out_dir, payload)
    print(f"\n{len(trace)} requests, {cfg.sessions} sessions x {cfg.turns} turns ({cfg.live_sessions} live), "
          f"{head['prompt_tokens']:.0f} prompt tokens, W={a.window}, full pool {a.full_slots}; hit rate = reused / "
          "prompt tokens; naive = equal-tokens rule on the same matches; unsafe = its hits past the window-safe length")
    print(markdown_table(rows, ["config", "hit_rate", "naive_hit_rate", "unsafe_hits", "unsafe_frac_of_naive",
                                "prefill_tokens", "full_used_mean", "swa_used_mean", "swa_per_full_used",
                                "swa_used_peak", "failed"]))
    print(f"SUMMARY engine_prefix {len(trace)} req / {cfg.sessions} sessions, W={a.window}, full pool "
          f"{a.full_slots}, SWA pool {a.headline_swa}: window-safe hit {head['hit_rate']:.3f} ({big['hit_rate']:.3f} "
          f"with SWA {max(swa_sizes)}; keeping the branch-point window {head_keep['hit_rate']:.3f} / "
          f"{big_keep['hit_rate']:.3f}); naive claims {head['naive_hit_rate']:.3f} with {head['unsafe_hits']:.0f}/"
          f"{head['requests']:.0f} unsafe hits ({head['unsafe_frac_of_naive']:.1%} of its tokens read freed SWA); "
          f"no cache 0.000; prefill tokens {head['prefill_tokens']:.0f} vs {no_cache['prefill_tokens']:.0f} "
          f"uncached; SWA slots used {head['swa_used_mean']:.0f} vs full {head['full_used_mean']:.0f} mean "
          f"({head['swa_per_full_used']:.1%}); sim {sim_s:.1f}s; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
