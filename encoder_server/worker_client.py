"""The gateway's asyncio client for one encoder worker (ZeroMQ DEALER -> the worker's ROUTER).

One receiver task reads every reply and resolves the request it belongs to; requests never block each
other. If the worker process dies, every request in flight fails at once with a clear error.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.asyncio

from encoder_server import messages as m

log = logging.getLogger(__name__)


class WorkerUnavailable(Exception):
    """The worker is not running or died while the request was in flight."""


@dataclass
class ItemOutput:
    result: m.ItemResult
    array: np.ndarray | None  # float32 [D] or [tokens, D]; None on error


@dataclass
class _Pending:
    num_items: int
    outputs: dict[int, ItemOutput] = field(default_factory=dict)
    done: asyncio.Future[dict[int, ItemOutput]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class WorkerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.ready: m.WorkerReady | None = None
        self.dead_reason: str | None = None
        self.num_inflight_items = 0
        self.last_pong = 0.0
        self._ready_event = asyncio.Event()
        self._pending: dict[str, _Pending] = {}
        self._receiver: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start reading replies (call from the event loop)."""
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive())

    async def wait_ready(self, timeout_s: float) -> m.WorkerReady:
        """Ping until the worker answers (it binds after loading its model)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._ready_event.is_set():
            if self.dead_reason:
                raise WorkerUnavailable(self.dead_reason)
            if loop.time() > deadline:
                raise WorkerUnavailable(f"worker at {self.address} not ready after {timeout_s:.0f} s")
            await self.sock.send(m.pack(m.Ping()))
            try:
                await asyncio.wait_for(self._ready_event.wait(), timeout=0.5)
            except TimeoutError:
                pass
        assert self.ready is not None
        return self.ready

    async def encode(self, items: list[m.EncodeItem], blobs: list[bytes], pooling: str,
                     timeout_s: float) -> dict[int, ItemOutput]:
        """Send one request; return every item's output by index (errors included)."""
        if self.dead_reason or self.ready is None:
            raise WorkerUnavailable(self.dead_reason or "worker is not ready yet")
        request_id = uuid.uuid4().hex
        pending = _Pending(len(items))
        self._pending[request_id] = pending
        self.num_inflight_items += len(items)
        try:
            req = m.EncodeRequest(request_id, tuple(items), pooling)
            await self.sock.send_multipart([m.pack(req), *blobs], copy=False)
            return await asyncio.wait_for(asyncio.shield(pending.done), timeout=timeout_s)
        finally:
            self.num_inflight_items -= len(items)
            self._pending.pop(request_id, None)

    async def ping(self) -> None:
        """Ask for a WorkerReady; its arrival refreshes `last_pong`."""
        await self.sock.send(m.pack(m.Ping()))

    def revive(self) -> None:
        """The worker is being restarted: forget the death so `wait_ready` can succeed again."""
        self.dead_reason = None

    def mark_dead(self, reason: str) -> None:
        """Fail everything in flight (called when the worker process exits)."""
        self.dead_reason = reason
        self.ready = None
        self._ready_event.clear()
        for pending in self._pending.values():
            if not pending.done.done():
                pending.done.set_exception(WorkerUnavailable(reason))

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = m.unpack(frames[0].bytes)
            except ValueError as e:
                log.error("malformed reply from worker %s: %s", self.address, e)
                continue
            if isinstance(msg, m.WorkerReady):
                self.last_pong = asyncio.get_running_loop().time()
                if self.dead_reason is None:
                    self.ready = msg
                    self._ready_event.set()
            elif isinstance(msg, m.ItemResult):
                self._on_result(msg, frames[1:])

    def _on_result(self, res: m.ItemResult, frames: list[zmq.Frame]) -> None:
        pending = self._pending.get(res.request_id)
        if pending is None:  # timed out or cancelled: drop
            return
        array = m.frame_tensor(frames[0].buffer, res.dtype, res.shape) if res.ok and frames else None
        pending.outputs[res.index] = ItemOutput(res, array)
        if len(pending.outputs) == pending.num_items and not pending.done.done():
            pending.done.set_result(pending.outputs)

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self.sock.close(linger=0)
