"""KV storage of the two pools and the per-request slot tables that address it.

`KVCache` owns one (K, V) tensor pair per layer: full-attention layers index the full pool
(`num_full_slots` rows), SWA layers the SWA pool (`num_swa_slots` rows, plus the always-zero sink row).
Which slot is free is the allocators' business (`kv_pool.SlotAllocator`); which slot holds which
position of a request is the request's `SlotTable`.
"""

from __future__ import annotations

import torch

from engine_link.engine.config import EngineModelConfig


class KVCache:
    def __init__(self, cfg: EngineModelConfig, num_full_slots: int, num_swa_slots: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.num_full_slots, self.num_swa_slots = num_full_slots, num_swa_slots
        self.dtype = dtype
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sink_slot = num_swa_slots  # SWA layers' extra last row: never allocated, stays zero (attention's sink)
        for layer in range(cfg.num_hidden_layers):
            rows = num_swa_slots + 1 if cfg.is_swa(layer) else num_full_slots
            heads = cfg.num_kv_heads(layer)
            k = torch.zeros(rows, heads, cfg.head_dim, device=device, dtype=dtype)  # [slots, Hkv, Dh]
            v = torch.zeros(rows, heads, cfg.v_head_dim, device=device, dtype=dtype)  # [slots, Hkv, Dv]
            self.layers.append((k, v))
        self.swa_layers = frozenset(cfg.swa_layers)

    def bytes_per_slot(self, swa: bool) -> int:
        """Bytes one slot of the full (or SWA) pool takes across all layers of that kind (real tensor sizes)."""
        total = 0
        for i, (k, v) in enumerate(self.layers):
            if (i in self.swa_layers) == swa:
                total += (k[0].numel() * k.element_size()) + (v[0].numel() * v.element_size())
        return total

    def total_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


class SlotTable:
    """Position -> slot of one request, for both pools. -1 marks a released (or never held) SWA slot.

    Positions below `num_borrowed` came from the prefix cache: their slots belong to the tree, never freed here.
    Storage grows by doubling, so appending one decode position is O(1) amortized.
    """

    def __init__(self) -> None:
        self._full = torch.empty(0, dtype=torch.int64)  # [capacity]
        self._swa = torch.empty(0, dtype=torch.int64)  # [capacity]
        self._len = 0
        self.num_borrowed = 0
        self.swa_released_upto = 0  # SWA slots of positions < this are released (-1)

    def __len__(self) -> int:
        return self._len

    @property
    def full(self) -> torch.Tensor:
        return self._full[:self._len]  # [num_positions] full-pool slots

    @property
    def swa(self) -> torch.Tensor:
        return self._swa[:self._len]  # [num_positions] SWA-pool slots, -1 where released

    def borrow(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        """Use the prefix tree's slots for positions [0, n): a match at admission (empty table), or the tree's copy
        of positions this request computed and just inserted (n <= len; its own slots for them now belong to the
        tree or were freed by it). `swa` is -1 before the window the request still reads."""
        n = full.numel()
        if self._len == 0:
            self.append(full, swa)
        else:
            assert n <= self._len and n >= self.num_borrowed
            self._full[:n] = full
            self._swa[:n] = swa
        self.num_borrowed = n
        missing = (swa < 0).nonzero()
        self.swa_released_upto = int(missing[-1]) + 1 if missing.numel() else 0

    def append(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        end = self._len + full.numel()
        if end > self._full.numel():
            capacity = max(end, 2 * self._full.numel(), 16)
            self._full = torch.cat([self._full[:self._len], torch.empty(capacity - self._len, dtype=torch.int64)])
            self._swa = torch.cat([self._swa[:self._len], torch.empty(capacity - self._len, dtype=torch.int64)])
        self._full[self._len:end] = full
        self._swa[self._len:end] = swa
        self._len = end

    def release_swa_before(self, position: int) -> torch.Tensor:
        """Drop SWA slots of positions < `position`; returns the ones this request owns (to free)."""
        start = self.swa_released_upto
        if position <= start:
            return torch.empty(0, dtype=torch.int64)
        released = self._swa[max(start, self.num_borrowed):position].clone()
        self._swa[start:position] = -1
        self.swa_released_upto = position
        return released[released >= 0]

    def owned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(full, swa) slots this request owns (not borrowed, not released): what a preemption frees."""
        full = self.full[self.num_borrowed:]
        swa = self.swa[self.num_borrowed:]
        return full, swa[swa >= 0]

    def clear(self) -> None:
        self.__init__()
