"""The gateway's asyncio client for the engine process (ZeroMQ DEALER -> the engine's ROUTER).

One receiver task reads every `TokenDelta` and routes it to its request's queue; a request that the HTTP
client abandons sends an `Abort`. If the engine dies, every request in flight ends at once with an error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from encoder_server import messages as m
from engine_link import protocol as p

log = logging.getLogger(__name__)


class EngineUnavailable(Exception):
    """The engine is not running, not ready, or died while the request was in flight."""


class EngineClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.ready: p.EngineReady | None = None
        self.dead_reason: str | None = None
        self.last_pong = 0.0
        self._ready_event = asyncio.Event()
        self._streams: dict[str, asyncio.Queue[p.TokenDelta | Exception]] = {}
        self._receiver: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive())

    async def wait_ready(self, timeout_s: float) -> p.EngineReady:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._ready_event.is_set():
            if self.dead_reason:
                raise EngineUnavailable(self.dead_reason)
            if loop.time() > deadline:
                raise EngineUnavailable(f"engine at {self.address} not ready after {timeout_s:.0f} s")
            await self.ping()
            try:
                await asyncio.wait_for(self._ready_event.wait(), timeout=0.5)
            except TimeoutError:
                pass
        assert self.ready is not None
        return self.ready

    async def ping(self) -> None:
        await self.sock.send(m.pack(m.Ping()))

    async def generate(self, msg: p.Generate, blobs: list[bytes]) -> AsyncIterator[p.TokenDelta]:
        """Send one request and yield its deltas until the finished one. Leaving early aborts the request."""
        if self.dead_reason or self.ready is None:
            raise EngineUnavailable(self.dead_reason or "the engine is not ready yet")
        stream: asyncio.Queue[p.TokenDelta | Exception] = asyncio.Queue()
        self._streams[msg.request_id] = stream
        finished = False
        try:
            await self.sock.send_multipart([p.pack(msg), *blobs], copy=False)
            while True:
                delta = await stream.get()
                if isinstance(delta, Exception):
                    raise delta
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            self._streams.pop(msg.request_id, None)
            if not finished and self.dead_reason is None:
                await self.sock.send(p.pack(p.Abort(msg.request_id)))

    def revive(self) -> None:
        self.dead_reason = None

    def mark_dead(self, reason: str) -> None:
        self.dead_reason, self.ready = reason, None
        self._ready_event.clear()
        for stream in self._streams.values():
            stream.put_nowait(EngineUnavailable(reason))

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg = p.unpack(frames[0])
            except ValueError as e:
                log.error("malformed message from the engine: %s", e)
                continue
            if isinstance(msg, p.EngineReady):
                self.last_pong = asyncio.get_running_loop().time()
                if self.dead_reason is None:
                    self.ready = msg
                    self._ready_event.set()
            elif isinstance(msg, p.TokenDelta) and (stream := self._streams.get(msg.request_id)) is not None:
                stream.put_nowait(msg)

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self.sock.close(linger=0)
