"""The encoder fleet: one worker process per GPU (or `--num-workers N`), supervised from the gateway's loop.

The supervisor starts the workers, pings them, restarts one that dies or stops answering (with
backoff), and picks the least-loaded ready worker for each request. Requests in flight on a worker
that dies fail at once (the gateway retries them once on another worker).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from cache.ring import Ring
from encoder_server import messages as m
from encoder_server import metrics
from encoder_server.config import ServerArgs
from encoder_server.worker import worker_main
from encoder_server.worker_client import WorkerClient, WorkerUnavailable

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # model load + compile warm-up
PING_INTERVAL_S = 2.0
PING_TIMEOUT_S = 30.0  # a worker whose socket thread is silent this long is killed and restarted
MAX_BACKOFF_S = 30.0


@dataclass
class WorkerSlot:
    index: int
    address: str
    device: str
    client: WorkerClient
    proc: BaseProcess | None = None
    restarts: int = 0
    backoff_s: float = 0.5


def num_workers(args: ServerArgs) -> int:
    if args.num_workers:
        return args.num_workers
    if args.worker.device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def worker_device(args: ServerArgs, index: int) -> str:
    if args.worker.device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{index % torch.cuda.device_count()}"
    return args.worker.device


class Fleet:
    def __init__(self, args: ServerArgs, run_dir: Path) -> None:
        self.args = args
        self.slots = [WorkerSlot(i, f"ipc://{run_dir}/worker-{i}", worker_device(args, i),
                                 WorkerClient(f"ipc://{run_dir}/worker-{i}")) for i in range(num_workers(args))]
        self.ring = Ring()  # addresses of the ready workers
        self._by_address = {s.address: s.client for s in self.slots}
        self._ctx = mp.get_context("spawn")
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def clients(self) -> list[WorkerClient]:
        return [s.client for s in self.slots]

    async def start(self) -> None:
        """Start every worker and wait until all answer; raise if one dies while starting."""
        for slot in self.slots:
            slot.client.start()
            self._spawn(slot)
        try:
            await asyncio.gather(*(s.client.wait_ready(START_TIMEOUT_S) for s in self.slots))
        except WorkerUnavailable:
            await self.stop()
            raise
        for slot in self.slots:
            self.ring.add(slot.address)
        self._background(self._health_loop())

    def pick(self, exclude: WorkerClient | None = None) -> WorkerClient:
        """The ready worker with the fewest items in flight."""
        ready = [s.client for s in self.slots if s.client.ready is not None and s.client is not exclude]
        if not ready:
            raise WorkerUnavailable("no encoder worker is ready")
        return min(ready, key=lambda c: c.num_inflight_items)

    def route(self, items: list[m.EncodeItem]) -> dict[WorkerClient, list[m.EncodeItem]]:
        """Split items by the ready worker that owns each one's route key on the ring (same media, same
        worker, so its cache hits); least-loaded for items without a key."""
        groups: dict[WorkerClient, list[m.EncodeItem]] = {}
        for item in items:
            try:
                client = self._by_address[self.ring.node_for(item.route_key)] if item.route_key else self.pick()
            except LookupError:
                raise WorkerUnavailable("no encoder worker is ready") from None
            groups.setdefault(client, []).append(item)
        return groups

    def _spawn(self, slot: WorkerSlot) -> None:
        worker_cfg = dataclasses.replace(self.args.worker, device=slot.device)
        proc = self._ctx.Process(
            # NOTE: not daemonic, since a worker has fetch processes of its own; it dies with us (PDEATHSIG).
            target=worker_main, name=f"mmenc-worker-{slot.index}", daemon=False,
            args=(slot.index, slot.address, worker_cfg, self.args.preprocess, self.args.fetch, self.args.log_level))
        proc.start()
        slot.proc = proc
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, self._on_exit, slot, proc)
        log.info("started mmenc-worker-%d (pid %d, %s)", slot.index, proc.pid, slot.device)

    def _on_exit(self, slot: WorkerSlot, proc: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(1)
        metrics.mark_process_dead(proc.pid or 0)
        reason = f"mmenc-worker-{slot.index} exited with code {proc.exitcode}"
        self.ring.remove(slot.address)
        slot.client.mark_dead(reason)
        if self._stopping:
            return
        log.error("%s; restarting in %.1f s", reason, slot.backoff_s)
        self._background(self._restart(slot))

    async def _restart(self, slot: WorkerSlot) -> None:
        await asyncio.sleep(slot.backoff_s)
        slot.backoff_s = min(slot.backoff_s * 2, MAX_BACKOFF_S)
        if self._stopping:
            return
        slot.restarts += 1
        metrics.WORKER_RESTARTS.labels(f"worker-{slot.index}").inc()
        slot.client.revive()
        self._spawn(slot)
        try:
            await slot.client.wait_ready(START_TIMEOUT_S)
            self.ring.add(slot.address)
            slot.backoff_s = 0.5
            log.info("mmenc-worker-%d is back (restart %d)", slot.index, slot.restarts)
        except WorkerUnavailable as e:
            log.error("mmenc-worker-%d did not come back: %s", slot.index, e)

    async def _health_loop(self) -> None:
        """Ping ready workers; kill one whose socket thread has been silent for PING_TIMEOUT_S."""
        while not self._stopping:
            now = asyncio.get_running_loop().time()
            for slot in self.slots:
                client, proc = slot.client, slot.proc
                if client.ready is None or proc is None or not proc.is_alive():
                    continue
                if now - client.last_pong > PING_TIMEOUT_S:
                    log.error("mmenc-worker-%d silent for %.0f s; killing it", slot.index, now - client.last_pong)
                    os.kill(proc.pid or 0, signal.SIGKILL)
                else:
                    await client.ping()
            await asyncio.sleep(PING_INTERVAL_S)

    def _background(self, coro) -> None:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        for slot in self.slots:
            await slot.client.close()
            if slot.proc is not None and slot.proc.is_alive():
                slot.proc.terminate()
        for slot in self.slots:
            if slot.proc is not None:
                slot.proc.join(10)
                if slot.proc.is_alive():
                    slot.proc.kill()
