"""Cache-hit simulation behind `mmenc bench cache`: Zipf requests over a media catalogue, LRU caches per encoder.

Pure CPU (numpy + the stdlib); the routing under test is our `cache.ring.Ring` on `cache.keys.route_key`.
Policies, all with the same total cache memory (`num_encoders x capacity` items):
- `round_robin` / `random`: request i goes to encoder i mod E / a seeded random one; an LRU of C per encoder.
- `consistent`: the encoder that owns the media URL's route key on the ring; an LRU of C per encoder.
- `consistent_shm`: the same routing, but the encoders of one machine share one LRU (the shm arena) of
  `workers_per_machine x C`. With every encoder on one machine this is exactly `ideal`.
- `ideal`: one LRU of E x C in front of everything (the reference).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache.keys import route_key
from cache.ring import Ring

POLICIES = ("round_robin", "random", "consistent", "consistent_shm", "ideal")


@dataclass(frozen=True)
class Workload:
    """Seeded Zipf(s) requests over `num_distinct` media ids (popularity rank shuffled against the id)."""

    num_requests: int = 100_000
    num_distinct: int = 100_000
    zipf_s: float = 1.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_distinct < 1:
            raise ValueError("need num_requests >= 1 and num_distinct >= 1")
        if self.zipf_s <= 0:
            raise ValueError("zipf_s must be > 0")

    def requests(self) -> np.ndarray:
        """Media ids, `[num_requests]` int64: P(rank k) ~ k^-s over a finite catalogue, vectorized draws."""
        rng = np.random.default_rng(self.seed)
        weights = np.arange(1, self.num_distinct + 1, dtype=np.float64) ** -self.zipf_s  # [num_distinct]
        cdf = np.cumsum(weights)
        ranks = np.searchsorted(cdf, rng.random(self.num_requests) * cdf[-1], side="right")  # [num_requests]
        ranks = np.minimum(ranks, self.num_distinct - 1)
        id_of_rank = rng.permutation(self.num_distinct)
        return id_of_rank[ranks]


def media_url(media_id: int) -> str:
    return f"https://media.example/img/{media_id}.jpg"


def node_names(num_encoders: int) -> list[str]:
    return [f"tcp://10.0.{i // 250}.{i % 250 + 1}:7100" for i in range(num_encoders)]


def lru_hits(items: np.ndarray, cache_of: np.ndarray, num_caches: int, capacity: int,
             split: int | None = None) -> tuple[int, int]:
    """Hits of LRU caches (an OrderedDict each, `capacity` items) when request i looks up `items[i]` in cache
    `cache_of[i]`; a miss inserts the item and evicts that cache's least recently used one.

    Returns:
        (hits among requests[:split], hits among requests[split:]); `split` defaults to all requests.
    """
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_caches)]
    split = len(items) if split is None else split
    hits = [0, 0]
    for i, (item, c) in enumerate(zip(items.tolist(), cache_of.tolist(), strict=True)):
        cache = caches[c]
        if item in cache:
            cache.move_to_end(item)
            hits[i >= split] += 1
        elif capacity > 0:
            cache[item] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits[0], hits[1]


def ring_owners(ring: Ring, media_ids: np.ndarray) -> np.ndarray:
    """Index into `ring.nodes` of the owner of each media id's URL route key, `[len(media_ids)]`."""
    index = {node: i for i, node in enumerate(ring.nodes)}
    return np.array([index[ring.node_for(route_key(url=media_url(m)))] for m in media_ids.tolist()], dtype=np.int64)


def routes(policy: str, requests: np.ndarray, ring: Ring, workers_per_machine: int,
           seed: int) -> tuple[np.ndarray, int, int]:
    """(cache index per request, number of caches, encoders per cache) for `policy`."""
    num_encoders = len(ring)
    if policy == "round_robin":
        return np.arange(len(requests)) % num_encoders, num_encoders, 1
    if policy == "random":
        return np.random.default_rng(seed + 1).integers(num_encoders, size=len(requests)), num_encoders, 1
    if policy == "ideal":
        return np.zeros(len(requests), dtype=np.int64), 1, num_encoders
    distinct, inverse = np.unique(requests, return_inverse=True)
    encoder = ring_owners(ring, distinct)[inverse]  # [num_requests]
    if policy == "consistent":
        return encoder, num_encoders, 1
    if policy == "consistent_shm":
        num_machines = -(-num_encoders // workers_per_machine)
        return encoder // workers_per_machine, num_machines, workers_per_machine
    raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")


def hit_rate_sweep(work: Workload, num_encoders: int, capacity_fracs: list[float], workers_per_machine: int,
                   progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One row per capacity fraction: hit rate of every policy, overall and over the second (warm) half.

    `capacity_fracs` is the share of the distinct media that all caches together hold: C = frac x distinct / E.
    """
    requests = work.requests()
    ring = Ring(node_names(num_encoders))
    plans = {p: routes(p, requests, ring, workers_per_machine, work.seed) for p in POLICIES}
    half = len(requests) // 2
    rows = []
    for frac in capacity_fracs:
        capacity = max(1, round(frac * work.num_distinct / num_encoders))
        row: dict[str, Any] = {"capacity_frac": frac, "capacity_items": capacity,
                               "total_items": capacity * num_encoders}
        for policy, (cache_of, num_caches, per_cache) in plans.items():
            cold, warm = lru_hits(requests, cache_of, num_caches, capacity * per_cache, split=half)
            row[policy] = (cold + warm) / len(requests)
            row[f"{policy}_warm"] = warm / (len(requests) - half)
        row["ch_vs_rr"] = row["consistent"] / row["round_robin"]
        row["ideal_gap_pts"] = 100 * (row["ideal"] - row["consistent"])
        rows.append(row)
        if progress:
            progress(row)
    return rows


def ring_churn(num_encoders: int, media_ids: np.ndarray) -> dict[str, Any]:
    """Fraction of route keys that change owner when one encoder leaves (each in turn) or one joins.

    Bound checked: moved <= 1/N + 2% with N the ring size before the change; a removal must move only
    the removed node's keys, an addition only onto the new node.
    """
    nodes = node_names(num_encoders + 1)
    ring = Ring(nodes[:num_encoders])
    keys = [route_key(url=media_url(m)) for m in media_ids.tolist()]
    before = [ring.node_for(k) for k in keys]
    bound = 1 / num_encoders + 0.02
    removals = []
    for node in nodes[:num_encoders]:
        ring.remove(node)
        after = [ring.node_for(k) for k in keys]
        ring.add(node)
        moved_from = [b for b, a in zip(before, after, strict=True) if a != b]
        removals.append({"node": node, "moved_frac": len(moved_from) / len(keys),
                         "only_own_keys_moved": set(moved_from) <= {node}})
    ring.add(nodes[-1])
    moved_to = [a for b, a in zip(before, (ring.node_for(k) for k in keys), strict=True) if a != b]
    add = {"node": nodes[-1], "moved_frac": len(moved_to) / len(keys), "ideal_frac": 1 / (num_encoders + 1),
           "only_onto_new_node": set(moved_to) <= {nodes[-1]}}
    worst_remove = max(r["moved_frac"] for r in removals)
    return {"num_keys": len(keys), "num_encoders": num_encoders, "bound": bound, "removals": removals, "add": add,
            "remove_mean_frac": float(np.mean([r["moved_frac"] for r in removals])),
            "remove_max_frac": worst_remove,
            "ok": (worst_remove <= bound and add["moved_frac"] <= bound and add["only_onto_new_node"]
                   and all(r["only_own_keys_moved"] for r in removals))}
