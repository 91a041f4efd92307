"""The worker's socket thread: owns the ROUTER socket, so the encode loop never touches ZeroMQ directly.

Incoming requests go to a callback (which starts their fetches); outgoing results arrive from the encode
loop over an inproc PUSH/PULL pair and leave through the ROUTER to the peer that asked, or, for a request
with `reply_to`, through a PUSH socket connected to that address (one per address, kept while used).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from encoder_server import messages as m

log = logging.getLogger(__name__)

OnRequest = Callable[[bytes, m.EncodeRequest, list[zmq.Frame]], None]
PUSH_PREFIX = b"push:"  # first frame of an outgoing message: a ROUTER identity, or this + a reply_to address
_PUSH_IDLE_S = 300.0  # a reply_to socket unused this long is closed
_PUSH_HWM = 10000


def destination(identity: bytes, reply_to: str) -> bytes:
    """The first frame that sends a result to `reply_to` when set, else back to the ROUTER peer `identity`."""
    return PUSH_PREFIX + reply_to.encode() if reply_to else identity


class WorkerIO:
    """Runs `serve()` on a daemon thread. `sender()` gives the encode loop its own PUSH socket."""

    def __init__(self, address: str, on_request: OnRequest, ready: m.WorkerReady) -> None:
        self.ctx = zmq.Context.instance()
        self.address = address
        self.on_request = on_request
        self.ready = ready
        self._results_address = f"inproc://results-{uuid.uuid4().hex}"
        self._stop_address = f"inproc://stop-{uuid.uuid4().hex}"
        self._router = self.ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._router.bind(address)
        self._results = self.ctx.socket(zmq.PULL)
        self._results.bind(self._results_address)
        self._stop = self.ctx.socket(zmq.PULL)
        self._stop.bind(self._stop_address)
        self._thread = threading.Thread(target=self.serve, name="worker-io", daemon=True)
        self._pushes: dict[bytes, tuple[zmq.Socket, float]] = {}  # reply_to address -> (PUSH, last use)

    def start(self) -> None:
        self._thread.start()

    def sender(self) -> zmq.Socket:
        """A PUSH socket for the calling thread; send `[identity, header, *frames]` on it."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(self._results_address)
        return sock

    def stop(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(self._stop_address)
        sock.send(b"")
        sock.close(linger=1000)
        self._thread.join(timeout=5)

    def serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self._router, self._results, self._stop):
            poller.register(sock, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._stop in events:
                break
            if self._results in events:
                self._send(self._results.recv_multipart(copy=False))
            if self._router in events:
                self._handle(self._router.recv_multipart(copy=False))
        for sock in (self._router, self._results, self._stop, *(p for p, _ in self._pushes.values())):
            sock.close(linger=0)

    def _send(self, frames: list[zmq.Frame]) -> None:
        dest = frames[0].bytes
        if not dest.startswith(PUSH_PREFIX):
            self._router.send_multipart(frames, copy=False)
            return
        now = time.monotonic()
        push = self._pushes.get(dest, (None, 0.0))[0]
        if push is None:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.setsockopt(zmq.SNDHWM, _PUSH_HWM)
            push.connect(dest[len(PUSH_PREFIX):].decode())
            for address, (idle, used) in list(self._pushes.items()):
                if now - used > _PUSH_IDLE_S:
                    idle.close(linger=0)
                    del self._pushes[address]
        self._pushes[dest] = (push, now)
        try:
            push.send_multipart(frames[1:], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # the receiver is gone or far behind: its deadline will report the item
            log.warning("dropping a result for %s: the receiver does not take it", dest[len(PUSH_PREFIX):].decode())

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity, header, payload = frames[0].bytes, frames[1].bytes if len(frames) > 1 else b"", frames[2:]
        try:
            msg = m.unpack(header)
        except ValueError as e:
            log.warning("dropping malformed message from %s: %s", identity.hex(), e)
            return
        if isinstance(msg, m.Ping):
            self._router.send_multipart([identity, m.pack(self.ready)])
        elif isinstance(msg, m.EncodeRequest):
            if sum(it.inline for it in msg.items) != len(payload):
                log.warning("request %s: inline item count does not match its frames", msg.request_id)
                return
            if msg.reply_to and not msg.reply_to.startswith(("tcp://", "ipc://")):
                log.warning("request %s: reply_to %r is not a tcp:// or ipc:// address", msg.request_id,
                            msg.reply_to[:100])
                return
            if msg.reply_to:
                self._router.send_multipart([identity, m.pack(m.Accepted(msg.request_id, self.ready.pid))])
            self.on_request(identity, msg, payload)
        else:
            log.warning("unexpected %s from %s", type(msg).__name__, identity.hex())
