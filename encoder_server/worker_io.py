"""The worker's socket thread: owns the ROUTER socket, so the encode loop never touches ZeroMQ directly.

Incoming requests go to a callback (which starts their fetches); outgoing results arrive from the encode
loop over an inproc PUSH/PULL pair and leave through the ROUTER to the peer that asked.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import zmq

from encoder_server import messages as m

log = logging.getLogger(__name__)

OnRequest = Callable[[bytes, m.EncodeRequest, list[zmq.Frame]], None]


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
                self._router.send_multipart(self._results.recv_multipart(copy=False), copy=False)
            if self._router in events:
                self._handle(self._router.recv_multipart(copy=False))
        for sock in (self._router, self._results, self._stop):
            sock.close(linger=0)

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
            self.on_request(identity, msg, payload)
        else:
            log.warning("unexpected %s from %s", type(msg).__name__, identity.hex())
