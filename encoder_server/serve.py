"""`mmenc serve`: the supervisor process. Spawns the encoder worker, hosts the gateway, stops cleanly."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import shutil
import tempfile

from aiohttp import web

from encoder_server.config import ServerArgs
from encoder_server.gateway import CLIENTS, build_app
from encoder_server.logs import set_process_name, setup_logging
from encoder_server.worker import worker_main
from encoder_server.worker_client import WorkerClient

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 600.0


def sample_data_uri() -> str:
    """A small solid-colour PNG as a data: URI, for the printed curl example."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(buf, "PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def banner(args: ServerArgs) -> str:
    base = f"http://{args.host}:{args.port}"
    image = sample_data_uri()
    return f"""
mmenc is serving {args.model_name} ({args.worker.vision_model}) on {base}

  curl -s {base}/v1/embeddings -H 'Content-Type: application/json' \\
    -d '{{"input": "{image}"}}' | head -c 300

  .venv/bin/python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); \\
print(len(c.embeddings.create(model='{args.model_name}', input=['{image}']).data[0].embedding))"

  health: {base}/health   models: {base}/v1/models   stop: Ctrl-C
"""


def serve(args: ServerArgs) -> None:
    setup_logging(args.log_level)
    set_process_name("mmenc-serve")
    run_dir = tempfile.mkdtemp(prefix="mmenc-")
    address = f"ipc://{run_dir}/worker-0"
    proc = mp.get_context("spawn").Process(
        target=worker_main, args=(address, args.worker, args.preprocess, args.fetch, args.log_level),
        name="mmenc-worker-0", daemon=True)
    proc.start()
    app = build_app(args)

    async def start_workers(app: web.Application) -> None:
        client = WorkerClient(address)
        app[CLIENTS].append(client)
        loop = asyncio.get_running_loop()

        def on_exit() -> None:
            loop.remove_reader(proc.sentinel)
            proc.join(0)
            log.error("encoder worker exited (code %s)", proc.exitcode)
            client.mark_dead(f"encoder worker exited with code {proc.exitcode}")

        loop.add_reader(proc.sentinel, on_exit)
        ready = await client.wait_ready(WORKER_START_TIMEOUT_S)
        log.info("worker ready: device %s, embedding dim %d", ready.device, ready.out_dim)
        print(banner(args), flush=True)

    async def stop_workers(app: web.Application) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)  # an exit from here on is expected
        for client in app[CLIENTS]:
            await client.close()
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(run_dir, ignore_errors=True)

    app.on_startup.append(start_workers)
    app.on_cleanup.append(stop_workers)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
