"""The machine-wide lock of a shared-memory arena: `flock` on the arena file, dropped by the kernel when its
holder dies, plus a `threading.Lock` that orders the threads of one process.

NOTE: a flock belongs to an open file description, which a forked child shares with its parent; the child
would "hold" the parent's lock. So the lock remembers its pid and, in a forked child, reopens the file
(`/proc/self/fd/N`, the same inode even if the name was unlinked) for a description of its own.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time


class ArenaLock:
    """Exclusive, machine-wide, timed lock on an open arena file.

    Args:
        fd: an fd of the arena file, owned by this lock from now on (closed by `close`).
    """

    def __init__(self, fd: int) -> None:
        self.fd, self.pid = fd, os.getpid()
        self._tlock = threading.Lock()

    def acquire(self, timeout_s: float) -> bool:
        """Take the lock; False when it stays busy for `timeout_s` seconds."""
        if self.pid != os.getpid():
            self._reopen_after_fork()
        start = 0.0
        if not self._tlock.acquire(False):  # NOTE: fast paths first; the timed waits are the rare case
            start = time.monotonic()
            if not self._tlock.acquire(timeout=timeout_s):
                return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not flock_within(self.fd, timeout_s - (time.monotonic() - start if start else 0.0)):
                self._tlock.release()
                return False
        return True

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self._tlock.release()

    def close(self) -> None:
        os.close(self.fd)

    def _reopen_after_fork(self) -> None:
        fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
        os.close(self.fd)  # the parent's copy stays open (and keeps its lock, if it holds it)
        self.fd, self.pid = fd, os.getpid()
        self._tlock = threading.Lock()  # a parent thread may have held it at fork time


def flock_within(fd: int, timeout_s: float) -> bool:
    """Exclusive flock on `fd` within `timeout_s` seconds."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    # NOTE: flock has no timed wait; holds are short (an index update or one payload copy), so back off
    # from 20 us to 1 ms between tries.
    deadline, delay = time.monotonic() + timeout_s, 2e-5
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(delay, left))
        delay = min(2 * delay, 1e-3)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            continue
    return False
