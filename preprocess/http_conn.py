"""Connection plumbing for `preprocess.fetch`: deadline-bounded socket I/O and a per-process keep-alive pool."""

from __future__ import annotations

import io
import select
import socket
import ssl
import threading
import time

MAX_IDLE = 32  # kept-alive connections per process, all hosts together; the least recently used go first
MAX_IDLE_S = 30.0
ConnKey = tuple[str, str, int, str]  # (scheme, host, port, address)


def remaining(deadline: float) -> float:
    """Seconds left until `deadline` (time.monotonic); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left



class DeadlineSocket(io.RawIOBase):
    """What http.client needs of a socket, with every send/recv bounded by one overall deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def _arm(self) -> socket.socket:
        self._sock.settimeout(remaining(self._deadline))
        return self._sock

    def sendall(self, data: bytes) -> None:
        self._arm().sendall(data)

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        return io.BufferedReader(self)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        return self._arm().recv_into(buffer)

    def close(self) -> None:
        pass  # http.client "closes" when it hands the stream to the response; the fetcher closes


class IdleConnections:
    """Kept-alive sockets as (key, socket, idle since), oldest first; key = (scheme, host, port, address)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # NOTE: a socket is used by one thread at a time: it leaves the list
        self._idle: list[tuple[ConnKey, socket.socket, float]] = []

    def take(self, keys: set[ConnKey]) -> tuple[socket.socket, str] | None:
        """An open connection under one of `keys` (addresses validated for this hop), and its address."""
        while True:
            with self._lock:
                i = next((i for i in reversed(range(len(self._idle))) if self._idle[i][0] in keys), None)
                if i is None:
                    return None
                key, sock, since = self._idle.pop(i)
            if time.monotonic() - since < MAX_IDLE_S and is_quiet(sock):
                return sock, key[3]
            sock.close()

    def put(self, key: ConnKey, sock: socket.socket) -> None:
        now = time.monotonic()
        with self._lock:
            self._idle.append((key, sock, now))
            num_old = max(len(self._idle) - MAX_IDLE, sum(now - since >= MAX_IDLE_S for *_, since in self._idle))
            dropped, self._idle = self._idle[:num_old], self._idle[num_old:]
        for _, old, _ in dropped:
            old.close()

    def clear(self) -> None:
        with self._lock:
            dropped, self._idle = self._idle, []
        for _, sock, _ in dropped:
            sock.close()


def is_quiet(sock: socket.socket) -> bool:
    """Nothing to read, not even EOF: the server has neither closed the connection nor said anything."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)
