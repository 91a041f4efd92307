"""Token-granular KV slot allocation (page size 1) for one KV pool: the full-attention pool or the SWA pool.

The engine keeps two pools (issue 6, section 2): the full-attention pool holds O(sequence) slots per request,
the SWA pool O(window). Each pool is one `SlotAllocator` over `num_slots` slot indices; the KV tensors that
the indices address belong to the model runner. The prefix tree (`radix.SwaRadixCache`) and the scheduler
hand slots back here; every slot is either free here or owned by exactly one request or tree node.
"""

from __future__ import annotations

import torch


class SlotAllocator:
    """Free list of slot indices `0..num_slots-1` (int64, CPU).

    alloc/free cost depends on the n slots concerned, not on `num_slots`.
    A double free (a slot freed while already free) raises `ValueError` and changes nothing.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # NOTE: a stack whose top is the end of _free[:_num_free]; seeded so that the first allocs hand out 0, 1, ...
        self._free = torch.arange(num_slots - 1, -1, -1, dtype=torch.int64)  # [num_slots]
        self._num_free = num_slots
        self._is_free = torch.ones(num_slots, dtype=torch.bool)  # [num_slots]

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` free slots.

        Args:
            n: number of slots (>= 0).
        Returns:
            int64 `[n]` slot indices, or None (and nothing taken) when fewer than `n` are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._num_free:
            return None
        start = self._num_free - n
        slots = self._free[start:self._num_free].flip(0).clone()  # [n]
        self._num_free = start
        self._is_free.index_fill_(0, slots, False)
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Give slots back; entries < 0 (released or never allocated) are ignored.

        Raises:
            ValueError: a slot is out of range, repeated in `slots`, or already free (double free).
        """
        slots = torch.as_tensor(slots, dtype=torch.int64).reshape(-1)
        slots = slots[slots >= 0]  # [k]
        if slots.numel() == 0:
            return
        if int(slots.max()) >= self.num_slots:
            raise ValueError(f"slot {int(slots.max())} out of range for a pool of {self.num_slots}")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("double free: a slot appears more than once in one free() call")
        already = self._is_free.index_select(0, slots)  # [k]
        if bool(already.any()):
            bad = slots[already][:8].tolist()
            raise ValueError(f"double free of slots {bad} (already free)")
        k = slots.numel()
        self._free[self._num_free:self._num_free + k] = slots.flip(0)
        self._num_free += k
        self._is_free.index_fill_(0, slots, True)

    def num_free(self) -> int:
        """Slots free now."""
        return self._num_free

    def num_used(self) -> int:
        """Slots held by requests or the prefix tree."""
        return self.num_slots - self._num_free

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool `[n]`: whether each slot (all >= 0) is free now; for checks and tests."""
        return self._is_free.index_select(0, torch.as_tensor(slots, dtype=torch.int64).reshape(-1))

    def free_slots(self) -> torch.Tensor:
        """int64 `[num_free]` copy of the free slots (no order promised); for checks and tests."""
        return self._free[:self._num_free].clone()
