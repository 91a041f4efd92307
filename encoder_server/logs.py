"""Logging setup and process naming shared by the supervisor and its children."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

_PR_SET_NAME = 15


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s",
        force=True,
    )


def set_process_name(name: str) -> None:
    """Name this process for `ps -o comm`/`top` (Linux, 15 characters) and for log lines."""
    import multiprocessing

    multiprocessing.current_process().name = name
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
