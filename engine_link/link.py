"""The engine's side of the encoder link: items go to encoder workers over the consistent-hash ring, and the
workers push each item's size and then its embedding straight back to this process (`reply_to`).

One IO thread owns every socket: a PULL bound at `address` (the `reply_to` of every request), one DEALER
per worker (requests out, `Accepted` in) and an inproc PULL that wakes it for new submissions. The
scheduler reads `ItemEvent`s from `events` (a `queue.Queue`): "sized" (token count and grid, before the
forward), then "embedding" or "error" (exactly one of these per item).

Reliability:
- a worker that does not answer `Accepted` within `accept_timeout_s`, or that has items of ours and stops
  answering pings for `lost_after_s` (it died), is taken as unreachable: its open items go once to the next
  node of the ring; when that fails too, they fail with `unavailable` (503);
- every item has a deadline (`item_timeout_s`); past it the item fails with `timeout` (504) and a late
  result is dropped.
Messages are `encoder_server.messages` headers plus raw tensor frames; nothing is pickled.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from cache.ring import ROUTE_SLACK, Ring
from encoder_server import messages as m

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkConfig:
    accept_timeout_s: float = 2.0  # a worker that does not take a request this fast is skipped
    item_timeout_s: float = 120.0  # from submission to the item's embedding
    ping_interval_s: float = 1.0  # workers holding our items are pinged this often
    lost_after_s: float = 4.0  # ... and taken as dead when silent this long
    route_balance: float = 1.25  # bounded loads, as the gateway's --route-balance (0: strict ring)

    def __post_init__(self) -> None:
        if not (self.accept_timeout_s > 0 and self.item_timeout_s > 0 and self.ping_interval_s > 0
                and self.lost_after_s > self.ping_interval_s):
            raise ValueError("link timeouts must be > 0 and lost_after_s > ping_interval_s")
        if not (self.route_balance == 0 or self.route_balance >= 1):
            raise ValueError("route_balance must be 0 (off) or >= 1")


@dataclass
class ItemEvent:
    """What the link learned about one item of a submitted request."""

    kind: str  # "sized" | "embedding" | "error"
    request_id: str
    index: int
    modality: str = ""
    num_tokens: int = 0
    grid_thw: tuple[int, int, int] | None = None
    embedding: torch.Tensor | None = None  # float32 [tokens, D] (kind "embedding")
    content_key: str = ""  # kind "sized": the embedding's cache key, when the worker knows it
    error_code: str = ""
    error_message: str = ""
    error_status: int = 200
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class _Group:
    """The items of one request that went to one worker (one `EncodeRequest`)."""

    request_id: str
    items: list[m.EncodeItem]
    blobs: dict[int, bytes]
    pooling: str
    node: str = ""
    tried: set[str] = field(default_factory=set)
    accept_by: float = math.inf
    sent_at: float = 0.0
    is_accepted: bool = False
    pid: int = 0  # the worker process that accepted it (a restarted worker has lost it)
    open_items: set[int] = field(default_factory=set)
    sized_items: set[int] = field(default_factory=set)


class EncoderLink:
    """Send media items to encoder workers; receive their sizes and embeddings as `events`.

    Args:
        workers: ZeroMQ addresses of the encoder workers (ring nodes).
        address: where this process receives (`tcp://host:port` or `ipc://path`); default: a free
            loopback TCP port. `reply_to` of every request.
        cfg: timeouts.
        events: the queue to put `ItemEvent`s on (default: a new one), e.g. one the caller also feeds.
    """

    def __init__(self, workers: list[str], address: str = "", cfg: LinkConfig | None = None,
                 events: queue.Queue | None = None) -> None:
        if not workers:
            raise ValueError("EncoderLink needs at least one worker address")
        self.cfg = cfg or LinkConfig()
        self.events: queue.Queue[ItemEvent] = events if events is not None else queue.Queue()
        self.ctx = zmq.Context.instance()
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        if address:
            self._pull.bind(address)
            self.address = address
        else:
            port = self._pull.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{port}"
        self._dealers: dict[str, zmq.Socket] = {}
        for worker in workers:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(worker)
            self._dealers[worker] = sock
        self._ring = Ring(workers)
        self._wake_address = f"inproc://link-wake-{uuid.uuid4().hex}"
        self._wake = self.ctx.socket(zmq.PULL)
        self._wake.bind(self._wake_address)
        self._waker = self.ctx.socket(zmq.PUSH)
        self._waker.connect(self._wake_address)
        self._lock = threading.Lock()  # guards `_submitted`, `_waker`, `_is_closed`
        self._submitted: collections.deque[tuple[str, list[m.EncodeItem], dict[int, bytes], str]] = collections.deque()
        self._is_closed = False
        self._groups: dict[str, _Group] = {}  # sub-request id -> group (IO thread only, like all below)
        self._deadlines: dict[tuple[str, int], float] = {}  # (request id, index) -> monotonic deadline
        self._group_ids = itertools.count()
        self._last_seen: dict[str, float] = {}  # worker -> when it last sent anything on its DEALER
        self._next_ping = math.inf
        self._thread = threading.Thread(target=self._run, name="encoder-link", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, items: list[m.EncodeItem], blobs: dict[int, bytes] | None = None,
               pooling: str = "none") -> None:
        """Queue a request's items (thread-safe, non-blocking). `blobs`: inline bytes by item index."""
        if not items:
            return
        with self._lock:
            if self._is_closed:
                raise RuntimeError("EncoderLink is closed")
            self._submitted.append((request_id, list(items), dict(blobs or {}), pooling))
            self._waker.send(b"")

    def close(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            if self._thread.is_alive():
                self._waker.send(b"")
        self._thread.join(timeout=5)

    # -------------------------------------------------------------- IO thread

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._pull, self._wake, *self._dealers.values()):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                timeout = self._next_timer() - time.monotonic()
                events = dict(poller.poll(None if timeout == math.inf else max(0, int(timeout * 1000) + 1)))
                if self._wake in events:
                    while self._wake.poll(0):
                        self._wake.recv()
                    with self._lock:
                        if self._is_closed:
                            break
                        submitted, self._submitted = list(self._submitted), collections.deque()
                    for request_id, items, blobs, pooling in submitted:
                        self._guarded(self._route, request_id, items, blobs, pooling)
                for node, sock in self._dealers.items():
                    if sock in events:
                        self._last_seen[node] = time.monotonic()
                        self._guarded(self._on_dealer, node, sock.recv_multipart())
                if self._pull in events:
                    self._guarded(self._on_result, self._pull.recv_multipart(copy=False))
                self._guarded(self._expire, time.monotonic())
                self._guarded(self._ping, time.monotonic())
        except Exception:
            log.exception("encoder link IO thread failed")
        finally:
            for sock in (self._pull, self._wake, self._waker, *self._dealers.values()):
                sock.close(linger=0)

    @staticmethod
    def _guarded(step, *args) -> None:  # noqa: ANN001
        """Run one handler; a bug in it is logged and costs that message, not the link (and every request)."""
        try:
            step(*args)
        except Exception:
            log.exception("encoder link: %s failed", step.__name__)

    def _route(self, request_id: str, items: list[m.EncodeItem], blobs: dict[int, bytes], pooling: str) -> None:
        deadline = time.monotonic() + self.cfg.item_timeout_s
        by_node: dict[str, list[m.EncodeItem]] = {}
        loads = self._open_items_by_node()
        for it in items:
            key = it.route_key or uuid.uuid4().hex
            node = (self._ring.node_within_bound(key, loads, self.cfg.route_balance, ROUTE_SLACK)
                    if self.cfg.route_balance else self._ring.node_for(key))
            loads[node] = loads.get(node, 0) + 1
            by_node.setdefault(node, []).append(it)
            self._deadlines[(request_id, it.index)] = deadline
        for node, group_items in by_node.items():
            group = _Group(request_id, group_items, {i.index: blobs[i.index] for i in group_items if i.inline}, pooling)
            group.open_items = {i.index for i in group_items}
            self._send(group, node)

    def _open_items_by_node(self) -> dict[str, int]:
        """Items each worker holds for us and has not answered yet (the bounded-load routing's loads)."""
        loads: dict[str, int] = {}
        for group in {id(g): g for g in self._groups.values()}.values():  # a re-sent group has two ids
            loads[group.node] = loads.get(group.node, 0) + len(group.open_items)
        return loads

    def _send(self, group: _Group, node: str) -> None:
        sub_id = f"{group.request_id}#{next(self._group_ids)}"
        self._groups[sub_id] = group
        now = time.monotonic()
        group.node, group.accept_by, group.sent_at = node, now + self.cfg.accept_timeout_s, now
        group.is_accepted, group.pid = False, 0
        group.tried.add(node)
        self._next_ping = min(self._next_ping, now + self.cfg.ping_interval_s)
        req = m.EncodeRequest(sub_id, tuple(group.items), group.pooling, reply_to=self.address)
        blobs = [group.blobs[it.index] for it in group.items if it.inline]
        self._dealers[node].send_multipart([m.pack(req), *blobs], copy=False)

    def _on_dealer(self, node: str, frames: list[bytes]) -> None:
        try:
            msg = m.unpack(frames[0])
        except ValueError as e:
            log.warning("malformed message from a worker: %s", e)
            return
        if isinstance(msg, m.Accepted) and msg.request_id in self._groups:
            group = self._groups[msg.request_id]
            group.is_accepted, group.pid = True, msg.pid
        elif isinstance(msg, m.WorkerReady):
            for group in self._groups.values():
                if group.node == node and group.is_accepted and group.pid and group.pid != msg.pid:
                    group.sent_at = -math.inf  # NOTE: restarted since it accepted: our items died with it

    def _on_result(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = m.unpack(frames[0].bytes)
        except ValueError as e:
            log.warning("malformed result from a worker: %s", e)
            return
        group = self._groups.get(getattr(msg, "request_id", ""))
        if group is None or msg.index not in group.open_items:
            return  # expired, retried elsewhere, or not ours
        group.is_accepted = True  # a result implies acceptance (the Accepted may still be on its way)
        if isinstance(msg, m.ItemSized):
            if msg.index not in group.sized_items:
                group.sized_items.add(msg.index)
                self.events.put(ItemEvent("sized", group.request_id, msg.index, msg.modality, msg.num_tokens,
                                          msg.grid_thw, content_key=msg.content_key))
            return
        if not isinstance(msg, m.ItemResult):
            return
        if msg.ok and msg.index not in group.sized_items:
            # NOTE: a worker's size and result leave through different sockets and may arrive in either
            # order; every item's "sized" event still comes first
            group.sized_items.add(msg.index)
            modality = next((it.modality for it in group.items if it.index == msg.index), "")
            self.events.put(ItemEvent("sized", group.request_id, msg.index, modality, msg.num_tokens, msg.grid_thw))
        if msg.ok:
            array = np.array(m.frame_tensor(frames[1].buffer, msg.dtype, msg.shape)) if len(frames) > 1 else None
            if array is None or array.ndim != 2:
                self._fail(group, msg.index, "internal", "encoder sent a malformed embedding", 500)
                return
            self.events.put(ItemEvent("embedding", group.request_id, msg.index, num_tokens=msg.num_tokens,
                                      grid_thw=msg.grid_thw, embedding=torch.from_numpy(array),
                                      timings_ms=msg.timings_ms))
        else:
            self.events.put(ItemEvent("error", group.request_id, msg.index, error_code=msg.error_code or "internal",
                                      error_message=msg.error_message or "", error_status=msg.error_status))
        self._close_item(group, msg.index)

    def _fail(self, group: _Group, index: int, code: str, message: str, status: int) -> None:
        self.events.put(ItemEvent("error", group.request_id, index, error_code=code, error_message=message,
                                  error_status=status))
        self._close_item(group, index)

    def _close_item(self, group: _Group, index: int) -> None:
        group.open_items.discard(index)
        self._deadlines.pop((group.request_id, index), None)
        if not group.open_items:
            for sub_id in [k for k, g in self._groups.items() if g is group]:
                del self._groups[sub_id]

    def _next_timer(self) -> float:
        accept = min((g.accept_by for g in self._groups.values() if not g.is_accepted), default=math.inf)
        return min(accept, self._next_ping, min(self._deadlines.values(), default=math.inf))

    def _ping(self, now: float) -> None:
        """Ping the workers that hold accepted items of ours (their answers refresh `_last_seen`)."""
        if now < self._next_ping:
            return
        nodes = {g.node for g in self._groups.values() if g.is_accepted}
        for node in nodes:
            self._dealers[node].send(m.pack(m.Ping()))
        self._next_ping = now + self.cfg.ping_interval_s if self._groups else math.inf

    def _is_lost(self, group: _Group, now: float) -> bool:
        if not group.is_accepted:
            return group.accept_by <= now
        if group.sent_at == -math.inf:
            return True
        return now - max(self._last_seen.get(group.node, 0.0), group.sent_at) > self.cfg.lost_after_s

    def _expire(self, now: float) -> None:
        for sub_id, group in list(self._groups.items()):
            if self._groups.get(sub_id) is not group or not self._is_lost(group, now):
                continue
            del self._groups[sub_id]  # a late Accepted or result for this sub-request is ignored
            untried = [n for n in self._ring.nodes if n not in group.tried]
            if untried:
                node = Ring(untried).node_for(group.items[0].route_key or group.request_id)
                log.warning("encoder %s %s request %s; retrying on %s", group.node,
                            "stopped answering with" if group.is_accepted else "did not accept", group.request_id,
                            node)
                group.items = [it for it in group.items if it.index in group.open_items]
                self._send(group, node)
                continue
            for index in list(group.open_items):
                self._fail(group, index, "unavailable", f"no encoder worker answered (tried {sorted(group.tried)})",
                           503)
        for (request_id, index), deadline in list(self._deadlines.items()):
            if deadline <= now:
                group = next((g for g in self._groups.values()
                              if g.request_id == request_id and index in g.open_items), None)
                if group is not None:
                    self._fail(group, index, "timeout", f"item not encoded within {self.cfg.item_timeout_s:g} s", 504)
                else:
                    del self._deadlines[(request_id, index)]
