"""A worker's view of the machine-wide embedding cache (`cache.shm.ShmEmbeddingCache`).

Entries are whole per-token embeddings in the model's dtype, shaped `[t, h/m, w/m, D]` so the grid
travels with them. Two kinds of key, both bound to this model's fingerprint and the preprocessing
parameters that change the output:
- content key: hash of the media bytes (computed by the fetch process);
- route key (client uuid, else URL, else inline bytes): known before any download. It stores an alias
  (the content key's bytes), so a repeated URL or uuid skips the download as well as the forward.
Writes go through a background thread so the encode loop never waits on a copy into the arena, except for
items named by a client uuid: those are written before their answer leaves (read-your-writes).
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from cache.keys import cache_key, content_key, params_of
from cache.shm import ShmEmbeddingCache
from encoder_server import metrics

log = logging.getLogger(__name__)

# Preprocessing fields that change an embedding (decode backend and limits do not).
KEY_FIELDS = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean",
              "image_std")
_MAX_PENDING_WRITES = 256


def arena_name(fingerprint: str) -> str:
    """One arena per machine and model: a restarted fleet of the same model finds it warm."""
    return f"mmenc-cache-{fingerprint[:16]}"


class WorkerCache:
    def __init__(self, fingerprint: str, prep: object, capacity_bytes: int, by_url: bool, name: str = "") -> None:
        self.fingerprint = fingerprint
        self.params = params_of(prep, KEY_FIELDS)
        self.by_url = by_url
        self.shm = ShmEmbeddingCache(name or arena_name(fingerprint), capacity_bytes, create=True)
        self._writes: queue.Queue[tuple[str | None, str, torch.Tensor] | None] = queue.Queue(_MAX_PENDING_WRITES)
        self._writer = threading.Thread(target=self._write_loop, name="cache-writer", daemon=True)
        self._writer.start()

    def route_key(self, route: str, has_uuid: bool, variant: str = "") -> str | None:
        """The pre-download key of an item, or None when such lookups are off for it (URLs, by flag).

        `variant` names what else changes the embedding: "" for images, the sampling for videos, the
        audio encoder for audio; it keeps one media's entries of different modalities/options apart.
        """
        if not route or not (has_uuid or self.by_url or route.startswith("b:")):
            return None
        return cache_key(route, self.params, self._fingerprint(variant))

    def content_key(self, digest: str, variant: str = "") -> str:
        return content_key(digest.encode(), self.params, self._fingerprint(variant))

    def _fingerprint(self, variant: str) -> str:
        return f"{self.fingerprint}|{variant}" if variant else self.fingerprint

    def get_by_route(self, key: str | None) -> tuple[str, torch.Tensor] | None:
        """(content key, embedding) through the alias stored under a route key."""
        alias = self.shm.get(key) if key else None
        if alias is None:
            metrics.CACHE_LOOKUPS.labels("route", "miss").inc()
            return None
        return self.get(bytes(alias.numpy()).decode(), "route")

    def get(self, key: str, kind: str = "content") -> tuple[str, torch.Tensor] | None:
        tensor = self.shm.get(key)
        metrics.CACHE_LOOKUPS.labels(kind, "hit" if tensor is not None else "miss").inc()
        return (key, tensor) if tensor is not None else None

    def put(self, route_key: str | None, key: str, embedding: torch.Tensor, wait: bool = False) -> None:
        """Write `embedding` under `key` (+ an alias under `route_key`): now when `wait`, else queued to the
        writer thread and dropped when that is backed up."""
        if wait:
            self._write(route_key, key, embedding)
            return
        try:
            self._writes.put_nowait((route_key, key, embedding))
        except queue.Full:
            metrics.CACHE_LOOKUPS.labels("write", "dropped").inc()

    def alias(self, route_key: str | None, key: str) -> None:
        if route_key:
            self.shm.put(route_key, torch.frombuffer(bytearray(key.encode()), dtype=torch.uint8))

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            self._write(*job)

    def _write(self, route: str | None, key: str, embedding: torch.Tensor) -> None:
        try:
            if self.shm.put(key, embedding):
                self.alias(route, key)
        except Exception:  # a cache must never take the worker down
            log.exception("cache write failed")

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=5)
        self.shm.close()
