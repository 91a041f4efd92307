"""Start a real `mmenc serve` process on loopback for end-to-end tests, and stop it."""

from __future__ import annotations

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

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`mmenc serve` with `flags` as a child process; `url` is its base URL once `start()` returns."""

    def __init__(self, *flags: str, startup_timeout_s: float = 120.0, cache_name: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # NOTE: each test server gets its own cache arena (unless told to share one), removed on stop(),
        # so a cache left by another test or an earlier run cannot answer for it.
        self.cache_name = cache_name or f"mmenc-cache-test-{os.getpid()}-{self.port}"
        # NOTE: no chat engine unless a test asks for one (`--llm tiny`): it would only slow the start.
        engine = [] if "--llm" in flags else ["--llm", "none"]
        self.flags = ["--cache-name", self.cache_name, "--cache-bytes", str(64 << 20), *engine, *flags]
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"mmenc-test-{self.port}.log"

    def start(self) -> ServerProcess:
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1")
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "encoder_server.cli", "serve", "--port", str(self.port), *self.flags],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status, _ = self.get("/health")
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {self.startup_timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self, keep_cache: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not keep_cache:
            from cache.shm import ShmEmbeddingCache

            if ShmEmbeddingCache.exists(self.cache_name):
                ShmEmbeddingCache(self.cache_name, 0, create=False).unlink()

    def get(self, path: str) -> tuple[int, Any]:
        return self._call(urllib.request.Request(self.url + path))

    def post(self, path: str, body: Any, raw: bytes | None = None, timeout: float = 60.0) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        return self._call(req, timeout)

    @staticmethod
    def _call(req: urllib.request.Request, timeout: float = 10.0) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
