"""Process setup shared by the supervisor and its children: logging, process names, metrics directory."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from pathlib import Path

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s",
        force=True,
    )


def _prctl(option: int, arg: int | bytes) -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(sig: int = 15) -> None:
    """Ask the kernel to send `sig` (SIGTERM) to this process when its parent dies (Linux)."""
    _prctl(_PR_SET_PDEATHSIG, sig)


def set_process_name(name: str) -> None:
    """Name this process for `ps -o comm`/`top` (Linux, 15 characters) and for log lines."""
    import multiprocessing

    multiprocessing.current_process().name = name
    _prctl(_PR_SET_NAME, name.encode()[:15])


def enable_multiprocess_metrics(directory: Path) -> None:
    """Share Prometheus metrics across processes through `directory` (see `encoder_server.metrics`).

    NOTE: must run before this process first imports prometheus_client; spawned children inherit it.
    """
    if "prometheus_client" in sys.modules:
        raise RuntimeError("enable_multiprocess_metrics must run before prometheus_client is imported")
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
