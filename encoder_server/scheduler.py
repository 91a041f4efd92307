"""Cross-request batching: ready items from every request -> encoder forwards.

Policy, in order:
1. One modality per forward: the modality of the oldest waiting item.
2. Oldest first: items of that modality are taken in arrival order, each one that still fits the token
   budget (`max_tokens`) and the item limit. The oldest item always goes in, so an item waits for at
   most as many forwards as there are items older than it (no starvation); an item larger than the
   budget runs alone.
3. While the encoder is busy, items accumulate; when it asks, everything that fits goes in. Under low
   load a forward that is not full waits up to `max_wait_s` for more items to arrive.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Generic, Protocol, TypeVar


class Schedulable(Protocol):
    modality: str

    @property
    def num_patches(self) -> int: ...


T = TypeVar("T", bound=Schedulable)


class BatchScheduler(Generic[T]):
    """Thread-safe: `put` from any thread, `next_batch` from the encode loop."""

    def __init__(self, max_tokens: int, max_items: int, max_wait_s: float = 0.0) -> None:
        self.max_tokens = max_tokens
        self.max_items = max_items
        self.max_wait_s = max_wait_s
        self._waiting: deque[T] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: T) -> None:
        with self._cond:
            self._waiting.append(item)
            self._cond.notify()

    def close(self) -> None:
        """Wake the encode loop; `next_batch` returns None once nothing is left."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting)

    def next_batch(self, block: bool = True) -> list[T] | None:
        """The next forward's items (oldest first); [] when not blocking and nothing waits; None when closed."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self._waiting or self._closed)
            if not self._waiting:
                return None if self._closed else []
            if self.max_wait_s > 0 and not self._is_full():
                deadline = time.monotonic() + self.max_wait_s
                while not self._closed and not self._is_full():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._cond.wait(remaining):
                        break
            return self._take()

    def _is_full(self) -> bool:
        modality = self._waiting[0].modality
        tokens = items = 0
        for item in self._waiting:
            if item.modality == modality:
                tokens, items = tokens + item.num_patches, items + 1
                if tokens >= self.max_tokens or items >= self.max_items:
                    return True
        return False

    def _take(self) -> list[T]:
        modality = self._waiting[0].modality
        batch: list[T] = []
        kept: deque[T] = deque()
        tokens = 0
        while self._waiting:
            item = self._waiting.popleft()
            fits = not batch or (tokens + item.num_patches <= self.max_tokens and len(batch) < self.max_items)
            if item.modality == modality and fits:
                batch.append(item)
                tokens += item.num_patches
            else:
                kept.append(item)
        self._waiting = kept
        return batch
