"""SlotAllocator: accounting, all-or-nothing alloc, double free refused, and a state machine against a set model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_link.engine.kv_pool import SlotAllocator


def test_alloc_free_accounting():
    pool = SlotAllocator(10)
    a = pool.alloc(4)
    assert a.dtype == torch.int64 and a.shape == (4,)
    assert pool.num_free() == 6 and pool.num_used() == 4
    b = pool.alloc(6)
    assert pool.num_free() == 0
    assert sorted(torch.cat([a, b]).tolist()) == list(range(10))
    pool.free(a)
    assert pool.num_free() == 4
    assert sorted(pool.free_slots().tolist()) == sorted(a.tolist())
    assert pool.alloc(0).shape == (0,)


def test_alloc_short_takes_nothing():
    pool = SlotAllocator(5)
    held = pool.alloc(3)
    assert pool.alloc(3) is None
    assert pool.num_free() == 2
    assert sorted(pool.alloc(2).tolist() + held.tolist()) == list(range(5))
    assert pool.alloc(1) is None


def test_free_ignores_negative_entries():
    pool = SlotAllocator(4)
    slots = pool.alloc(3)
    pool.free(torch.tensor([-1, int(slots[0]), -1]))
    assert pool.num_free() == 2
    pool.free(torch.full((5,), -1, dtype=torch.int64))
    assert pool.num_free() == 2


def test_double_free_refused_and_changes_nothing():
    pool = SlotAllocator(4)
    slots = pool.alloc(2)
    pool.free(slots[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free(slots)  # slots[0] is already free
    assert pool.num_free() == 3  # slots[1] was not freed by the refused call
    with pytest.raises(ValueError, match="double free"):
        pool.free(torch.stack([slots[1], slots[1]]))
    assert pool.num_free() == 3
    with pytest.raises(ValueError, match="out of range"):
        pool.free(torch.tensor([4]))
    with pytest.raises(ValueError):
        pool.alloc(-1)


class AllocatorMachine(RuleBasedStateMachine):
    """Held slots and free slots always partition 0..N-1; alloc fails exactly when too few are free."""

    N = 16

    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotAllocator(self.N)
        self.held: list[int] = []

    @rule(n=st.integers(0, 20))
    def alloc(self, n: int) -> None:
        slots = self.pool.alloc(n)
        if n > self.N - len(self.held):
            assert slots is None
        else:
            assert slots is not None and slots.shape == (n,)
            assert not set(slots.tolist()) & set(self.held)
            self.held += slots.tolist()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.held), unique=True, min_size=1))
        self.pool.free(torch.tensor(chosen + [-1]))
        self.held = [s for s in self.held if s not in chosen]

    @precondition(lambda self: len(self.held) < self.N)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        free_now = sorted(set(range(self.N)) - set(self.held))
        bad = data.draw(st.sampled_from(free_now))
        with pytest.raises(ValueError):
            self.pool.free(torch.tensor(self.held[:1] + [bad]))

    @invariant()
    def partition(self) -> None:
        free = self.pool.free_slots().tolist()
        assert len(free) == self.pool.num_free() == self.N - len(self.held)
        assert sorted(free + self.held) == list(range(self.N))


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
