"""Waiting-queue order: fewest uncached tokens first with a waiting-time credit, no starvation, FCFS, bad names."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_link.engine.policy import POLICIES, order_waiting


@dataclass
class Req:
    name: str
    uncached: int
    arrival: float


def _order(reqs: list[Req], now: float, policy: str = "fewest-uncached", penalty: float = 0.0) -> list[str]:
    out = order_waiting(reqs, uncached_tokens=lambda r: r.uncached, waited_s=lambda r: now - r.arrival,
                        policy=policy, penalty_tokens_per_s=penalty)
    return [r.name for r in out]


def test_fewest_uncached_first():
    reqs = [Req("long", 5000, 0.0), Req("short", 10, 0.1), Req("mid", 300, 0.2)]
    assert _order(reqs, now=0.3) == ["short", "mid", "long"]


def test_ties_go_to_earlier_arrival():
    reqs = [Req("b", 100, 1.0), Req("a", 100, 0.5), Req("c", 100, 1.0)]
    assert _order(reqs, now=2.0) == ["a", "b", "c"]


def test_penalty_lets_an_old_long_request_go_first():
    old = Req("old", 1000, 0.0)  # U / p = 10 s: overtaken only by requests that arrive within 10 s after it
    early = Req("early", 10, 8.0)
    late = Req("late", 10, 11.0)
    assert _order([old, early], now=8.5, penalty=100.0) == ["early", "old"]  # 1000-850=150 > 10-50=-40
    assert _order([old, early], now=11.5, penalty=100.0) == ["early", "old"]  # -150 > 10-350=-340
    assert _order([old, late], now=11.5, penalty=100.0) == ["old", "late"]  # -150 < 10-50=-40
    assert _order([old, late], now=1e6, penalty=0.0) == ["late", "old"]  # no penalty: pure shortest-first


def test_starvation_bound_under_a_stream_of_short_requests():
    """A stream of 1-token requests, one every 0.1 s, each admitted alone: the 2000-token request is admitted
    no later than U / p = 2 s after it arrived (plus one arrival interval), never starved."""
    penalty, long_tokens, dt = 1000.0, 2000, 0.1
    waiting = [Req("long", long_tokens, 0.0)]
    t, k = 0.0, 0
    while True:
        waiting.append(Req(f"s{k}", 1, t))
        k += 1
        first = order_waiting(waiting, uncached_tokens=lambda r: r.uncached, waited_s=lambda r, t=t: t - r.arrival,
                              policy="fewest-uncached", penalty_tokens_per_s=penalty)[0]
        waiting.remove(first)
        if first.name == "long":
            break
        t += dt
        assert t < 10, "long request starved"
    assert t <= long_tokens / penalty + dt


@given(st.lists(st.tuples(st.integers(0, 10_000), st.floats(0, 100)), max_size=20), st.floats(0, 1000))
def test_order_is_a_permutation_sorted_by_score(items: list[tuple[int, float]], penalty: float):
    reqs = [Req(str(i), u, a) for i, (u, a) in enumerate(items)]
    out = order_waiting(reqs, uncached_tokens=lambda r: r.uncached, waited_s=lambda r: 100.0 - r.arrival,
                        policy="fewest-uncached", penalty_tokens_per_s=penalty)
    assert sorted(r.name for r in out) == sorted(r.name for r in reqs)
    scores = [r.uncached - penalty * (100.0 - r.arrival) for r in out]
    assert scores == sorted(scores)


def test_fcfs_by_arrival():
    reqs = [Req("c", 1, 3.0), Req("a", 9999, 1.0), Req("b", 5, 2.0)]
    assert _order(reqs, now=5.0, policy="fcfs", penalty=100.0) == ["a", "b", "c"]
    assert _order([], now=0.0, policy="fcfs") == []


def test_bad_policy_name_lists_choices():
    with pytest.raises(ValueError, match="fewest-uncached.*fcfs"):
        _order([Req("a", 1, 0.0)], now=1.0, policy="sjf")
    with pytest.raises(ValueError, match="penalty"):
        _order([Req("a", 1, 0.0)], now=1.0, penalty=-1.0)
    assert POLICIES == ("fewest-uncached", "fcfs")
