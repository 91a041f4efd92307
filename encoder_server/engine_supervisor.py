"""Supervision of the engine process (`mmenc-engine`) from the gateway's loop: start it, ping it, restart it
(with backoff) when it dies or stops answering. Requests in flight on a dying engine end with a 503 at once."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
from multiprocessing.process import BaseProcess
from pathlib import Path

from encoder_server import metrics
from encoder_server.config import ServerArgs
from encoder_server.engine_client import EngineClient, EngineUnavailable
from engine_link.engine_process import engine_main

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
PING_INTERVAL_S = 2.0
PING_TIMEOUT_S = 30.0
MAX_BACKOFF_S = 30.0


class EngineSupervisor:
    def __init__(self, args: ServerArgs, run_dir: Path, worker_addresses: list[str]) -> None:
        self.args = args
        port = args.engine.engine_port
        self.bind = f"tcp://127.0.0.1:{port}" if port else f"ipc://{run_dir}/engine"
        self.client = EngineClient(self.bind)
        self.workers = worker_addresses
        self.proc: BaseProcess | None = None
        self.restarts = 0
        self._backoff_s = 0.5
        self._ctx = mp.get_context("spawn")
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.client.start()
        self._spawn()
        try:
            await self.client.wait_ready(START_TIMEOUT_S)
        except EngineUnavailable:
            await self.stop()
            raise
        self._background(self._health_loop())

    def _spawn(self) -> None:
        engine = self.args.engine
        proc = self._ctx.Process(target=engine_main, name="mmenc-engine", daemon=False, args=(
            self.bind, self.workers, engine.llm, engine.overrides(), self.args.log_level, engine.llm_overlap,
            self.args.route_balance))
        proc.start()
        self.proc = proc
        asyncio.get_running_loop().add_reader(proc.sentinel, self._on_exit, proc)
        log.info("started mmenc-engine (pid %d, %s)", proc.pid, engine.llm)

    def _on_exit(self, proc: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(1)
        metrics.mark_process_dead(proc.pid or 0)
        reason = f"mmenc-engine exited with code {proc.exitcode}"
        self.client.mark_dead(reason)
        if self._stopping:
            return
        log.error("%s; restarting in %.1f s", reason, self._backoff_s)
        self._background(self._restart())

    async def _restart(self) -> None:
        await asyncio.sleep(self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)
        if self._stopping:
            return
        self.restarts += 1
        metrics.WORKER_RESTARTS.labels("engine").inc()
        self.client.revive()
        self._spawn()
        try:
            await self.client.wait_ready(START_TIMEOUT_S)
            self._backoff_s = 0.5
            log.info("mmenc-engine is back (restart %d)", self.restarts)
        except EngineUnavailable as e:
            log.error("mmenc-engine did not come back: %s", e)

    async def _health_loop(self) -> None:
        while not self._stopping:
            proc = self.proc
            if self.client.ready is not None and proc is not None and proc.is_alive():
                silent_s = asyncio.get_running_loop().time() - self.client.last_pong
                if silent_s > PING_TIMEOUT_S:
                    log.error("mmenc-engine silent for %.0f s; killing it", silent_s)
                    os.kill(proc.pid or 0, signal.SIGKILL)
                else:
                    await self.client.ping()
            await asyncio.sleep(PING_INTERVAL_S)

    def _background(self, coro) -> None:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        await self.client.close()
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
