"""Consistent-hash ring over worker endpoints: uhashring's ketama ring behind a lock.

Same node for the same key as `uhashring.HashRing(nodes, hash_fn="ketama")` (libketama's continuum:
40 x 4 points per node of weight 1, md5), so any ketama client agrees with us. Removing a node moves
only that node's keys; adding one moves about 1/N of them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from uhashring import HashRing

ROUTE_SLACK = 4  # items a node may hold above the bounded-load limit (small bursts keep to their owners)


class Ring:
    """Thread-safe consistent hashing of route keys to node names (e.g. `tcp://host:port`).

    NOTE: uhashring rebuilds its continuum in place on add/remove, so a concurrent lookup could read a
    half-built ring; every access holds `self._lock`. Lookups are an md5 and a bisect (microseconds).
    """

    def __init__(self, nodes: Iterable[str] = (), weights: Mapping[str, int] | None = None) -> None:
        """Build the ring.

        Args:
            nodes: node names; duplicates are ignored.
            weights: optional relative weight per node (default 1); a node named only here is added too.
        """
        weights = dict(weights or {})
        conf = {node: weights.get(node, 1) for node in nodes}
        conf.update(weights)
        for node, weight in conf.items():
            _check_weight(node, weight)
        self._lock = threading.Lock()
        self._ring = HashRing(conf, hash_fn="ketama")

    def node_for(self, route_key: str) -> str:
        """The node that owns `route_key`.

        Raises:
            LookupError: when the ring has no nodes.
        """
        with self._lock:
            node = self._ring.get_node(route_key)
        if node is None:
            raise LookupError("the ring has no nodes")
        return node

    def node_within_bound(self, route_key: str, loads: Mapping[str, float], balance: float, slack: float) -> str:
        """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): the first node clockwise
        from `route_key` whose load is under `balance` x the mean load (this key included) + `slack`; the owner
        when every node is at the bound. With idle nodes this is `node_for`; under load a hot or unlucky node's
        keys spill to its ring successors, so no node queues far more than the others.

        Args:
            loads: current load per node (missing: 0), e.g. items in flight.
            balance: >= 1; the bound's multiple of the mean.
            slack: absolute headroom, so small bursts at low load keep to their owners.
        Raises:
            LookupError: when the ring has no nodes.
        """
        with self._lock:
            order = list(self._ring.iterate_nodes(route_key)) if self._ring.conf else []
        if not order:
            raise LookupError("the ring has no nodes")
        bound = balance * (sum(loads.get(n, 0) for n in order) + 1) / len(order) + slack
        return next((n for n in order if loads.get(n, 0) < bound), order[0])

    def add(self, node: str, weight: int = 1) -> None:
        """Add `node` (or change its weight); adding a node already there with the same weight is a no-op."""
        _check_weight(node, weight)
        with self._lock:
            current = self._ring.conf.get(node)
            if current is None or current["weight"] != weight:
                self._ring.add_node(node, {"weight": weight})

    def remove(self, node: str) -> None:
        """Remove `node`; removing a node that is not there is a no-op."""
        with self._lock:
            if node in self._ring.conf:
                self._ring.remove_node(node)

    @property
    def nodes(self) -> list[str]:
        """Node names, sorted."""
        with self._lock:
            return sorted(self._ring.conf)

    def weight(self, node: str) -> int:
        """The weight of `node`; KeyError when it is not on the ring."""
        with self._lock:
            return int(self._ring.conf[node]["weight"])

    def __len__(self) -> int:
        with self._lock:
            return len(self._ring.conf)

    def __contains__(self, node: object) -> bool:
        with self._lock:
            return node in self._ring.conf

    def __repr__(self) -> str:
        return f"Ring({self.nodes!r})"


def _check_weight(node: str, weight: int) -> None:
    if not isinstance(weight, int) or isinstance(weight, bool) or weight < 1:
        raise ValueError(f"node {node!r}: weight must be an integer >= 1, got {weight!r}")
