"""One request's runtime state: tokens, progress, slot tables, prefix-cache lock, sampler state."""

from __future__ import annotations

import enum
import hashlib
import itertools
import time
from dataclasses import dataclass, field

import torch

from engine_link.engine.kv_cache import SlotTable
from engine_link.engine.sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def content_key_of(key: int | bytes | str | None, values: torch.Tensor | None) -> int | None:
    """A media identity as an int: ints pass, bytes/str are hashed, None hashes the values (None if pending)."""
    if key is None:
        if values is None:
            return None
        key = values.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    if isinstance(key, int):
        return key
    data = key.encode() if isinstance(key, str) else key
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


@dataclass
class EmbedSegment:
    """Embeddings that replace the token embeddings of positions start..start+length-1 of a prompt.

    `values` is None while the embedding has not arrived (the encoder is still at work): prefill stops
    before `start` until `LLM.add_embeds` provides it.
    """

    start: int
    length: int
    values: torch.Tensor | None  # [length, hidden]
    content_key: int | None  # identity of the media; equal keys must mean equal embeddings

    @property
    def end(self) -> int:
        return self.start + self.length

    def key_ids(self, offset: int, request_id: str) -> list[int]:
        """Prefix-cache key ids of this run: a pseudo id >= `offset` (out of vocab) from the content key, so
        equal media share a prefix and different media never do. Without a key yet: unique to this request."""
        key = self.content_key
        if key is None:
            key = content_key_of(f"pending:{request_id}:{self.start}", None)
        return [offset + key] * self.length


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    embeds: list[EmbedSegment] = field(default_factory=list)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_computed: int = 0  # positions whose KV is in the pools
    num_cached: int = 0  # positions reused from the prefix cache at the last admission
    slots: SlotTable = field(default_factory=SlotTable)
    radix_node: object | None = None  # locked prefix-cache path while running
    use_prefix_cache: bool = True
    key_offset: int = 0  # vocab size: start of the pseudo ids of embedding runs
    generator: torch.Generator | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    num_preemptions: int = 0
    first_token_at: float | None = None
    steps_since_release: int = 0
    _key: tuple | None = field(default=None, repr=False)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_pending(self) -> int:
        """Positions still to compute before the next token can be sampled."""
        return len(self) - self.num_computed

    @property
    def is_prefill(self) -> bool:
        return self.num_pending > 1

    def ready_end(self, start: int) -> int:
        """Computing from position `start`, the end of what is computable now: the sequence's end, or the first
        position (>= start) of an embedding run that has not arrived."""
        return min([max(start, seg.start) for seg in self.embeds if seg.values is None and seg.end > start],
                   default=len(self))

    def key_tokens(self) -> torch.Tensor:
        """Prefix-cache key [len]: the tokens, each embedding run replaced by its content-key pseudo ids.

        NOTE: cached while the sequence and its embedding keys do not change (waiting requests are matched
        every step to order the queue).
        """
        version = (len(self), tuple(seg.content_key for seg in self.embeds))
        if self._key is None or self._key[0] != version:
            tokens = self.tokens
            for seg in self.embeds:
                tokens[seg.start:seg.end] = seg.key_ids(self.key_offset, self.request_id)
            self._key = (version, torch.tensor(tokens, dtype=torch.int64))
        return self._key[1]

    def embeds_in(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(offset from `start`, values) of embedding rows that fall in positions start..end-1."""
        out = []
        for seg in self.embeds:
            lo, hi = max(start, seg.start), min(end, seg.end)
            if lo < hi:
                out.append((lo - start, seg.values[lo - seg.start:hi - seg.start]))
        return out
