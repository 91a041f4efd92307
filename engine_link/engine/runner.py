"""Model runner: packs the scheduled sequences into one forward, writes their KV, samples their next tokens."""

from __future__ import annotations

import torch

from engine_link.engine.attention import AttnGroup, AttnMetadata, build_group
from engine_link.engine.kv_cache import KVCache
from engine_link.engine.model import MiMoV2FlashForCausalLM
from engine_link.engine.sampling import sample
from engine_link.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: MiMoV2FlashForCausalLM, kv: KVCache, device: torch.device) -> None:
        self.model, self.kv, self.device = model, kv, device
        self.window = model.cfg.sliding_window

    def run(self, scheduled: list[tuple[Sequence, int]]) -> list[int | None]:
        """One forward over `scheduled` (sequence, new positions); a token for each sequence whose new
        positions reach its end (decodes and last prefill chunks), None for the others."""
        if not scheduled:
            return []
        ids, positions, full_write, swa_write, embed_rows, embed_values = [], [], [], [], [], []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        by_len: dict[int, list[tuple[int, Sequence, int, int]]] = {}  # q_len -> (row, seq, start, n)
        row = 0
        for seq, n in scheduled:
            start = seq.num_computed
            ids.extend(seq.tokens[start:start + n])
            positions.append(torch.arange(start, start + n))
            full_write.append(seq.slots.full[start:start + n])
            swa_write.append(seq.slots.swa[start:start + n])
            for offset, values in seq.embeds_in(start, start + n):
                embed_rows.append(torch.arange(row + offset, row + offset + values.shape[0]))
                embed_values.append(values)
            by_len.setdefault(n, []).append((row, seq, start, n))
            if start + n == len(seq):
                sample_rows.append(row + n - 1)
                sample_seqs.append(seq)
            row += n
        # NOTE: one attention group per query length (all decodes together; equal chunks together): no padding
        whole = len(by_len) == 1  # one group holds every row in packed order: no gather / scatter of rows
        groups = [self._group(items, n, whole) for n, items in by_len.items()]
        meta = AttnMetadata(groups, torch.cat(full_write).to(self.device), torch.cat(swa_write).to(self.device))
        embeds = None
        if embed_rows:
            embeds = (torch.cat(embed_rows).to(self.device), torch.cat(embed_values).to(self.device))
        hidden = self.model(torch.tensor(ids, device=self.device), torch.cat(positions).to(self.device), meta,
                            self.kv.layers, embeds)  # [T, D]
        tokens: dict[int, int] = {}
        if sample_seqs:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])  # [N, V]
            picked = sample(logits, [s.params for s in sample_seqs], [s.generator for s in sample_seqs])
            for i, (seq, token) in enumerate(zip(sample_seqs, picked, strict=True)):
                tokens[id(seq)] = token
                if seq.params.return_logits:
                    seq.logits.append(logits[i].cpu())
        return [tokens.get(id(seq)) for seq, _ in scheduled]

    def _group(self, items: list[tuple[int, Sequence, int, int]], q_len: int, whole: bool) -> AttnGroup:
        rows = None if whole else torch.cat([torch.arange(r, r + n) for r, _, _, n in items])
        starts = [start for _, _, start, _ in items]
        full = [seq.slots.full[:start + n] for _, seq, start, n in items]
        swa = [seq.slots.swa[max(0, start - self.window + 1):start + n] for _, seq, start, n in items]
        if any(bool((table < 0).any()) for table in swa):  # NOTE: slot -1 would silently read another row
            raise RuntimeError("internal error: released SWA KV inside a query's window")
        return build_group(rows, starts, q_len, full, swa, self.window, self.kv.sink_slot, self.device,
                           self.kv.dtype)
