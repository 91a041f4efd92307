"""Extra HTTP front processes (`--api-processes N`).

One gateway event loop does every request's CPU work: JSON parsing, routing, and base64 + the response
body of each embedding (a qwen2.5-vl-7b image is ~14 MB of base64). On a many-GPU machine that one loop,
not the GPUs, sets the ceiling. With N > 1, N - 1 more processes (`mmenc-api-1`, ...) serve the same app on
the same port (SO_REUSEPORT: the kernel spreads connections over the listening processes), each talking to
the fleet's workers and engine as remote peers over their ZeroMQ sockets. The main process keeps
supervising workers and engine, and restarts a front that exits (with backoff). Each process enforces its
share of `max_inflight_requests` and `max_worker_items`, so the fleet-wide bounds stay what was configured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import signal
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path

from aiohttp import web

from encoder_server import metrics
from encoder_server.config import ServerArgs
from encoder_server.engine_client import EngineClient, EngineUnavailable
from encoder_server.fleet import Fleet
from encoder_server.gateway import build_app
from encoder_server.logs import die_with_parent, set_process_name, setup_logging
from encoder_server.worker_client import WorkerUnavailable

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
MAX_BACKOFF_S = 30.0
ENGINE_PING_INTERVAL_S = 2.0
ENGINE_SILENT_S = 10.0  # a silent engine fails this front's chat requests until it answers again


class ApiFrontsUnavailable(RuntimeError):
    """A front process did not start listening in time."""


def share(args: ServerArgs) -> ServerArgs:
    """`args` with the request bounds one of `api_processes` processes enforces (rounded up, at least 1)."""
    n = args.api_processes
    return dataclasses.replace(args, max_inflight_requests=-(-args.max_inflight_requests // n),
                               max_worker_items=-(-args.max_worker_items // n))


class ApiFronts:
    """Starts and restarts fronts 1..N-1 from the main process's event loop."""

    def __init__(self, args: ServerArgs, worker_addresses: list[str], engine_address: str | None) -> None:
        self.args = share(args)
        self.peers = (worker_addresses, engine_address)
        self._ctx = mp.get_context("spawn")
        self._procs: dict[int, BaseProcess] = {}
        self._backoff_s = {i: 0.5 for i in range(1, args.api_processes)}
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Start every front and wait until each listens; raise ApiFrontsUnavailable if one does not."""
        waits = [self._spawn(index) for index in self._backoff_s]
        loop = asyncio.get_running_loop()
        ok = await asyncio.gather(*(loop.run_in_executor(None, ready.wait, START_TIMEOUT_S) for ready in waits))
        if not all(ok):
            await self.stop()
            raise ApiFrontsUnavailable(
                f"an API front process did not start within {START_TIMEOUT_S:.0f} s (see the log above)")

    def _spawn(self, index: int) -> Event:
        ready = self._ctx.Event()
        proc = self._ctx.Process(target=front_main, name=f"mmenc-api-{index}", daemon=True,
                                 args=(index, self.args, *self.peers, ready))
        proc.start()
        self._procs[index] = proc
        asyncio.get_running_loop().add_reader(proc.sentinel, self._on_exit, index, proc)
        log.info("started mmenc-api-%d (pid %d)", index, proc.pid)
        return ready

    def _on_exit(self, index: int, proc: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(1)
        metrics.mark_process_dead(proc.pid or 0)
        if self._stopping:
            return
        delay = self._backoff_s[index]
        self._backoff_s[index] = min(delay * 2, MAX_BACKOFF_S)
        log.error("mmenc-api-%d exited with code %s; restarting in %.1f s", index, proc.exitcode, delay)
        task = asyncio.get_running_loop().create_task(self._restart(index, delay))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._stopping:
            return
        metrics.WORKER_RESTARTS.labels(f"api-{index}").inc()
        ready = self._spawn(index)
        if await asyncio.get_running_loop().run_in_executor(None, ready.wait, START_TIMEOUT_S):
            self._backoff_s[index] = 0.5
            log.info("mmenc-api-%d is back", index)

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        for proc in self._procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs.values():
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def front_main(index: int, args: ServerArgs, worker_addresses: list[str], engine_address: str | None,
               ready: Event) -> None:
    """Entry point of `mmenc-api-<index>`: serve the gateway app on the shared port until SIGTERM."""
    die_with_parent()
    set_process_name(f"mmenc-api-{index}")
    setup_logging(args.log_level)
    try:
        asyncio.run(_serve(index, args, worker_addresses, engine_address, ready))
    except (WorkerUnavailable, EngineUnavailable) as e:  # the supervisor restarts us with backoff
        log.error("mmenc-api-%d cannot serve: %s", index, e)
        raise SystemExit(1) from None


async def _serve(index: int, args: ServerArgs, worker_addresses: list[str], engine_address: str | None,
                 ready: Event) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    front_args = dataclasses.replace(args, num_workers=0, encoders=",".join(worker_addresses))
    fleet = Fleet(front_args, Path())  # every worker is remote here: pinged, never spawned
    await fleet.start()
    engine = None
    if engine_address is not None:
        engine = EngineClient(engine_address)
        engine.start()
        await engine.wait_ready(START_TIMEOUT_S)
    runner = web.AppRunner(build_app(front_args, fleet, engine, api_process=index), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_port=True, backlog=4096)
    await site.start()
    ready.set()
    log.info("mmenc-api-%d listening on %s:%d", index, args.host, args.port)
    watch = loop.create_task(_watch_engine(engine)) if engine is not None else None
    await stop.wait()
    if watch is not None:
        watch.cancel()
    await runner.cleanup()
    await fleet.stop()
    if engine is not None:
        await engine.close()


async def _watch_engine(engine: EngineClient) -> None:
    """Ping the engine (the main process restarts it when it dies); silent for ENGINE_SILENT_S: its requests
    here fail at once (503) until it answers again."""
    loop = asyncio.get_running_loop()
    while True:
        if engine.ready is not None and loop.time() - engine.last_pong > ENGINE_SILENT_S:
            engine.mark_dead(f"engine at {engine.address} silent for {ENGINE_SILENT_S:.0f} s")
        elif engine.ready is None:
            engine.revive()  # ready again once it answers this ping
        await engine.ping()
        await asyncio.sleep(ENGINE_PING_INTERVAL_S)
