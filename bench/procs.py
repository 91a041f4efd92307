"""Servers that `mmenc bench serve` starts itself (a child process on loopback, its log in a file), and the
synchronous calls the bench makes to them outside the load phases."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(HTTP status of GET url/health, body or reason); status 0 when it cannot be reached."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError) as e:  # URLError, refused, timeout, malformed URL
        return 0, str(getattr(e, "reason", e))


class ManagedServer:
    """`python -m <module> --port P <args>` in its own session; `url` answers once `wait_healthy()` returns.

    Args:
        name: short name for messages ("mmenc", "naive").
        module: the module to run with `python -m` (its CLI must take `--port`).
        args: further command-line arguments.
        log_path: where the child's stdout and stderr go.
    """

    def __init__(self, name: str, module: list[str], args: list[str], log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", *module, "--port", str(self.port), *args]
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.startup_s: float | None = None  # from start() to the first healthy answer

    def start(self) -> ManagedServer:
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll GET /health until 200.

        Raises:
            RuntimeError: the process exited, or was not healthy within `timeout_s` (with its log's tail).
        """
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with code {self.proc.returncode} during startup "
                                   f"({' '.join(self.argv[1:])}); log {self.log_path}:\n{self.log_tail()}")
            if health_status(self.url, timeout_s=2.0)[0] == 200:
                self.startup_s = time.monotonic() - self.started_at
                return
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} server not healthy after {timeout_s:.0f} s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGINT to the process group, SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _embed_one(url: str, blob: bytes) -> tuple[int, np.ndarray]:
    body = {"input": ["data:image/jpeg;base64," + base64.b64encode(blob).decode()], "encoding_format": "base64"}
    req = urllib.request.Request(url + "/v1/embeddings", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        item = json.loads(resp.read())["data"][0]
    return int(item["num_tokens"]), np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")


def compare_embeddings(url: str, naive_url: str, blob: bytes) -> dict[str, Any] | None:
    """Same image to both servers: token counts and cosine of the embeddings (same weights: close to 1)."""
    try:
        (tokens, ours), (naive_tokens, theirs) = _embed_one(url, blob), _embed_one(naive_url, blob)
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"embedding comparison failed: {e}", file=sys.stderr)
        return None
    cosine = None
    if len(ours) == len(theirs):
        cosine = float(ours @ theirs / (np.linalg.norm(ours) * np.linalg.norm(theirs)))
    return {"num_tokens": tokens, "naive_num_tokens": naive_tokens, "cosine": cosine}
