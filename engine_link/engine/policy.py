"""Waiting-queue order for prefill admission (issue 6, section 4; the MiMo article, section 3).

"fewest-uncached": requests with the fewest real (not prefix-cached) prefill tokens go first, so short
requests are not stuck behind long ones; a waiting-time penalty (credit) lets a long request overtake
newcomers once it has waited long enough, so nothing starves.

    score(r) = uncached_tokens(r) - penalty_tokens_per_s * waited_s(r)      (lowest first)

Ties go to the earlier arrival (longer wait, then position in `waiting`).

Starvation bound: with a penalty p > 0, a request with U uncached tokens scores below any request that
arrives more than U / p seconds after it (whose score is >= 0 - p * its shorter wait). So it is overtaken
only by requests that arrived before it or within U / p seconds after it, a finite set under any finite
arrival rate. With p = 0 the order is pure shortest-first and can starve.

"fcfs": by arrival (longest wait first), the baseline the benchmark compares against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

POLICIES = ("fewest-uncached", "fcfs")


def order_waiting(waiting: list, *, uncached_tokens: Callable[[Any], int], waited_s: Callable[[Any], float],
                  policy: str, penalty_tokens_per_s: float) -> list:
    """The waiting requests in the order the scheduler should try to admit them.

    Args:
        waiting: requests, in arrival order (used only to break exact ties).
        uncached_tokens: prefill tokens a request still has to compute (prompt minus its prefix-cache match).
        waited_s: seconds since the request arrived.
        policy: one of `POLICIES`.
        penalty_tokens_per_s: tokens of credit per second waited (>= 0); ignored by "fcfs".
    Returns:
        A new list with the same requests, first to admit first.
    Raises:
        ValueError: unknown policy or negative penalty.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown waiting-queue policy {policy!r}; choices: {', '.join(POLICIES)}")
    if penalty_tokens_per_s < 0:
        raise ValueError(f"penalty_tokens_per_s must be >= 0, got {penalty_tokens_per_s}")
    waits = [float(waited_s(r)) for r in waiting]
    if policy == "fcfs":
        keys = [(-w, i) for i, w in enumerate(waits)]
    else:
        keys = [(uncached_tokens(r) - penalty_tokens_per_s * w, -w, i)
                for i, (r, w) in enumerate(zip(waiting, waits, strict=True))]
    order = sorted(range(len(waiting)), key=keys.__getitem__)
    return [waiting[i] for i in order]
