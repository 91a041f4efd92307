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

from cache.ring import ROUTE_SLACK, Ring
from encoder_server import messages as m
from encoder_server import metrics
from encoder_server.config import ServerArgs
from encoder_server.worker import worker_main
from encoder_server.worker_client import WorkerClient, WorkerUnavailable

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # model load + compile warm-up
PING_INTERVAL_S = 2.0
PING_TIMEOUT_S = 30.0  # a worker whose socket thread is silent this long is killed and restarted
REMOTE_START_TIMEOUT_S = 30.0
REMOTE_PING_TIMEOUT_S = 6.0
MAX_BACKOFF_S = 30.0


@dataclass
class WorkerSlot:
    """A local worker process we supervise (`bind` set), or a remote worker we only ping."""

    index: int
    address: str  # where the client connects
    device: str
    client: WorkerClient
    bind: str | None = None  # where a local worker listens
    proc: BaseProcess | None = None
    restarts: int = 0
    backoff_s: float = 0.5

    @property
    def is_remote(self) -> bool:
        return self.bind is None


def num_workers(args: ServerArgs) -> int:
    if args.num_workers >= 0:
        return args.num_workers
    if args.worker.device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def worker_device(args: ServerArgs, index: int) -> str:
    if args.worker.device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{index % torch.cuda.device_count()}"
    return args.worker.device


async def _try_ready(client: WorkerClient) -> bool:
    try:
        await client.wait_ready(REMOTE_START_TIMEOUT_S)
        return True
    except WorkerUnavailable:
        return False


class Fleet:
    def __init__(self, args: ServerArgs, run_dir: Path) -> None:
        self.args = args
        self.slots = [self._local_slot(i, run_dir) for i in range(num_workers(args))]
        self.slots += [WorkerSlot(len(self.slots) + i, address, "remote", WorkerClient(address))
                       for i, address in enumerate(args.encoder_addresses)]
        self.ring = Ring()  # addresses of the ready workers
        self._by_address = {s.address: s.client for s in self.slots}
        self._ctx = mp.get_context("spawn")
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()

    def _local_slot(self, index: int, run_dir: Path) -> WorkerSlot:
        if self.args.worker_port:
            bind = f"tcp://{self.args.worker_host}:{self.args.worker_port + index}"
            host = "127.0.0.1" if self.args.worker_host in ("0.0.0.0", "*") else self.args.worker_host
            address = f"tcp://{host}:{self.args.worker_port + index}"
        else:
            bind = address = f"ipc://{run_dir}/worker-{index}"
        return WorkerSlot(index, address, worker_device(self.args, index), WorkerClient(address), bind=bind)

    @property
    def clients(self) -> list[WorkerClient]:
        return [s.client for s in self.slots]

    async def start(self) -> None:
        """Start every worker and wait until all answer; raise if one dies while starting."""
        local = [s for s in self.slots if not s.is_remote]
        for slot in self.slots:
            slot.client.start()
            if not slot.is_remote:
                self._spawn(slot)
        try:
            await asyncio.gather(*(s.client.wait_ready(START_TIMEOUT_S) for s in local))
            if not local:  # else a remote fleet that is not up yet joins the ring when it answers a ping
                await asyncio.gather(*(_try_ready(s.client) for s in self.slots))
        except WorkerUnavailable:
            await self.stop()
            raise
        self._update_ring()
        if not len(self.ring):
            await self.stop()
            raise WorkerUnavailable("no encoder worker answered (local or --encoders)")
        self._background(self._health_loop())

    def pick(self, exclude: WorkerClient | None = None) -> WorkerClient:
        """The ready worker with the fewest items in flight."""
        ready = [s.client for s in self.slots if s.client.ready is not None and s.client is not exclude]
        if not ready:
            raise WorkerUnavailable("no encoder worker is ready")
        return min(ready, key=lambda c: c.num_inflight_items)

    def route(self, items: list[m.EncodeItem]) -> dict[WorkerClient, list[m.EncodeItem]]:
        """Split items by the ready worker that owns each one's route key on the ring (same media, same
        worker, so its cache hits), with bounded loads (`--route-balance`): a worker holding more than that
        multiple of the mean items in flight (+ ROUTE_SLACK) passes keys on to its ring successor, so an
        unlucky split of the ring or a hot key cannot leave one GPU queueing while another idles (the cache is
        machine-wide, so a local spill still hits). Least-loaded for items without a key."""
        groups: dict[WorkerClient, list[m.EncodeItem]] = {}
        loads = {s.address: s.client.num_inflight_items for s in self.slots if s.client.ready is not None}
        balance = self.args.route_balance
        for item in items:
            try:
                if not item.route_key:
                    client = self.pick()
                elif balance:
                    address = self.ring.node_within_bound(item.route_key, loads, balance, ROUTE_SLACK)
                    if address != self.ring.node_for(item.route_key):
                        metrics.ROUTE_SPILLS.inc()
                    client = self._by_address[address]
                else:
                    client = self._by_address[self.ring.node_for(item.route_key)]
            except LookupError:
                raise WorkerUnavailable("no encoder worker is ready") from None
            loads[client.address] = loads.get(client.address, 0) + 1
            groups.setdefault(client, []).append(item)
        return groups

    def _spawn(self, slot: WorkerSlot) -> None:
        worker_cfg = dataclasses.replace(self.args.worker, device=slot.device)
        proc = self._ctx.Process(
            # NOTE: not daemonic, since a worker has fetch processes of its own; it dies with us (PDEATHSIG).
            target=worker_main, name=f"mmenc-worker-{slot.index}", daemon=False,
            args=(slot.index, slot.bind, worker_cfg, self.args.preprocess, self.args.fetch, self.args.log_level))
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
        """Ping workers. A local one silent for PING_TIMEOUT_S is killed (and restarted); a remote one
        silent for REMOTE_PING_TIMEOUT_S leaves the ring (its requests fail) and rejoins when it answers."""
        while not self._stopping:
            now = asyncio.get_running_loop().time()
            for slot in self.slots:
                client, proc = slot.client, slot.proc
                silent_s = now - client.last_pong
                if slot.is_remote:
                    if client.ready is not None and silent_s > REMOTE_PING_TIMEOUT_S:
                        log.error("remote worker %s silent for %.0f s; out of the ring", slot.address, silent_s)
                        client.mark_dead(f"remote worker {slot.address} stopped answering")
                    elif client.ready is None:
                        client.revive()  # ready again once it answers this ping
                    await client.ping()
                elif client.ready is not None and proc is not None and proc.is_alive():
                    if silent_s > PING_TIMEOUT_S:
                        log.error("mmenc-worker-%d silent for %.0f s; killing it", slot.index, silent_s)
                        os.kill(proc.pid or 0, signal.SIGKILL)
                    else:
                        await client.ping()
            self._update_ring()
            await asyncio.sleep(PING_INTERVAL_S)

    def _update_ring(self) -> None:
        for slot in self.slots:
            if slot.client.ready is not None:
                self.ring.add(slot.address)
            else:
                self.ring.remove(slot.address)

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
