"""Local media files for `preprocess.fetch`: only inside the allowed directory, regular files, size-limited."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from preprocess.errors import FetchError, ForbiddenSource, MediaError, MediaTooLarge

if TYPE_CHECKING:
    from preprocess.fetch import FetchPolicy

_MAX_SOURCE_IN_MESSAGE = 200


def local_path(source: str, policy: FetchPolicy) -> str:
    """The real path of a local source, required to lie inside `policy.allowed_local_dir`."""
    if policy.allowed_local_dir is None:
        raise ForbiddenSource("local files are not allowed (no allowed local media directory configured)")
    path = source
    if not source.startswith("/"):  # file: URL
        parts = urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise ForbiddenSource(f"file: URL with a remote host is not allowed: {_short(source)!r}")
        path = unquote(parts.path)
    if "\x00" in path or not path.startswith("/"):
        raise FetchError(f"invalid local path {_short(source)!r}")
    root = os.path.realpath(policy.allowed_local_dir)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ForbiddenSource(f"path {_short(source)!r} is outside the allowed local media directory")
    return real


def check_local(path_or_fd: str | int, max_bytes: int, source: str) -> None:
    try:
        st = os.stat(path_or_fd)
    except OSError:
        raise FetchError(f"cannot read local file {_short(source)!r}: no such file") from None
    if not stat.S_ISREG(st.st_mode):
        raise FetchError(f"cannot read local file {_short(source)!r}: not a regular file")
    if st.st_size > max_bytes:
        raise MediaTooLarge(f"media is larger than the limit of {max_bytes} bytes")


def read_local(path: str, max_bytes: int, source: str) -> bytes:
    # O_NONBLOCK: opening a FIFO must not hang; O_NOFOLLOW: the resolved path must not become a link.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        raise FetchError(f"cannot read local file {_short(source)!r}: no such file") from None
    try:
        check_local(fd, max_bytes, source)
    except MediaError:
        os.close(fd)
        raise
    with open(fd, "rb") as f:
        data = f.read(max_bytes + 1)  # the file may have grown since fstat
    if len(data) > max_bytes:
        raise MediaTooLarge(f"media is larger than the limit of {max_bytes} bytes")
    return data


def _short(text: str) -> str:
    return text if len(text) <= _MAX_SOURCE_IN_MESSAGE else text[: _MAX_SOURCE_IN_MESSAGE - 3] + "..."
