"""BatchScheduler: budget, modality, order, no starvation, wait window."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_server.scheduler import BatchScheduler


@dataclass
class Job:
    name: int
    num_patches: int
    modality: str = "image"


def test_everything_that_fits_goes_in_one_forward() -> None:
    sched = BatchScheduler[Job](max_tokens=100, max_items=10)
    for i in range(5):
        sched.put(Job(i, 20))
    sched.put(Job(5, 20))
    assert [j.name for j in sched.next_batch()] == [0, 1, 2, 3, 4]
    assert [j.name for j in sched.next_batch()] == [5]
    assert sched.next_batch(block=False) == []


def test_oversized_item_runs_alone_and_first() -> None:
    sched = BatchScheduler[Job](max_tokens=100, max_items=10)
    sched.put(Job(0, 500))
    sched.put(Job(1, 10))
    assert [j.name for j in sched.next_batch()] == [0]
    assert [j.name for j in sched.next_batch()] == [1]


def test_one_modality_per_forward_oldest_first() -> None:
    sched = BatchScheduler[Job](max_tokens=100, max_items=10)
    for i, modality in enumerate(["audio", "image", "audio", "image"]):
        sched.put(Job(i, 10, modality))
    first = sched.next_batch()
    assert [j.name for j in first] == [0, 2] and {j.modality for j in first} == {"audio"}
    assert [j.name for j in sched.next_batch()] == [1, 3]


def test_item_limit() -> None:
    sched = BatchScheduler[Job](max_tokens=10_000, max_items=3)
    for i in range(7):
        sched.put(Job(i, 1))
    assert [len(sched.next_batch()) for _ in range(3)] == [3, 3, 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.sampled_from(["image", "audio"])), min_size=1, max_size=40))
def test_every_item_once_and_waits_at_most_its_position(jobs: list[tuple[int, str]]) -> None:
    sched = BatchScheduler[Job](max_tokens=256, max_items=8)
    for i, (patches, modality) in enumerate(jobs):
        sched.put(Job(i, patches, modality))
    seen: list[int] = []
    forward = 0
    while batch := sched.next_batch(block=False):
        forward += 1
        assert len({j.modality for j in batch}) == 1
        assert len(batch) <= 8 and (len(batch) == 1 or sum(j.num_patches for j in batch) <= 256)
        for job in batch:
            assert forward <= job.name + 1  # no starvation: bounded by the number of older items
        seen += [j.name for j in batch]
    assert sorted(seen) == list(range(len(jobs)))


def test_wait_window_collects_late_arrivals() -> None:
    sched = BatchScheduler[Job](max_tokens=100, max_items=10, max_wait_s=0.5)
    sched.put(Job(0, 10))
    threading.Timer(0.05, lambda: sched.put(Job(1, 10))).start()
    start = time.monotonic()
    batch = sched.next_batch()
    assert [j.name for j in batch] == [0, 1]
    assert time.monotonic() - start < 0.5 + 0.2


def test_full_batch_does_not_wait() -> None:
    sched = BatchScheduler[Job](max_tokens=20, max_items=10, max_wait_s=5.0)
    sched.put(Job(0, 10))
    sched.put(Job(1, 10))
    start = time.monotonic()
    assert len(sched.next_batch()) == 2 and time.monotonic() - start < 1.0


def test_close_wakes_a_blocked_loop() -> None:
    sched = BatchScheduler[Job](max_tokens=20, max_items=10)
    threading.Timer(0.05, sched.close).start()
    assert sched.next_batch() is None
