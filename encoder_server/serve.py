"""`mmenc serve`: the supervisor process. Hosts the gateway and the encoder fleet, stops cleanly."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from aiohttp import web

from encoder_server.api_fronts import ApiFronts, ApiFrontsUnavailable, share
from encoder_server.config import ServerArgs
from encoder_server.engine_client import EngineUnavailable
from encoder_server.engine_supervisor import EngineSupervisor
from encoder_server.fleet import Fleet
from encoder_server.gateway import build_app
from encoder_server.logs import set_process_name, setup_logging
from encoder_server.worker_client import WorkerUnavailable

log = logging.getLogger(__name__)



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
    chat = "" if args.engine.llm == "none" else f"""\
  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "What is this?"}},
         {{"type": "image_url", "image_url": {{"url": "{image}"}}}}]}}], "max_tokens": 16}}'

"""
    return f"""
mmenc is serving {args.model_name} ({args.worker.vision_model}) on {base}

  curl -s {base}/v1/embeddings -H 'Content-Type: application/json' \\
    -d '{{"input": "{image}"}}' | head -c 300

  .venv/bin/python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); \\
print(len(c.embeddings.create(model='{args.model_name}', input=['{image}']).data[0].embedding))"

{chat}  health: {base}/health   models: {base}/v1/models   stop: Ctrl-C
"""


def serve(args: ServerArgs, run_dir: Path) -> None:
    """Run the gateway and the fleet until SIGINT/SIGTERM. `run_dir` holds sockets and metrics; removed at exit."""
    setup_logging(args.log_level)
    set_process_name("mmenc-serve")
    fleet = Fleet(args, run_dir)
    engine = (EngineSupervisor(args, run_dir, [s.address for s in fleet.slots]) if args.engine.llm != "none"
              else None)
    fronts = None
    if args.api_processes > 1:  # NOTE: the workers' and engine's sockets are the fronts' peers
        fronts = ApiFronts(args, [s.address for s in fleet.slots], engine.bind if engine else None)
    app = build_app(share(args), fleet, engine.client if engine else None)

    async def start_fleet(app: web.Application) -> None:
        await fleet.start()
        ready = fleet.slots[0].client.ready
        log.info("%d worker(s) ready: %s, embedding dim %d", len(fleet.slots),
                 ", ".join(s.device for s in fleet.slots), ready.out_dim if ready else -1)
        if engine is not None:
            try:
                await engine.start()
            except EngineUnavailable:
                await fleet.stop()
                raise
        if fronts is not None:
            try:
                await fronts.start()
            except ApiFrontsUnavailable:
                await stop_fleet(app)
                raise
            log.info("%d HTTP processes share port %d", args.api_processes, args.port)
        print(banner(args), flush=True)

    async def stop_fleet(app: web.Application) -> None:
        if fronts is not None:
            await fronts.stop()
        if engine is not None:
            await engine.stop()
        await fleet.stop()
        shutil.rmtree(run_dir, ignore_errors=True)

    app.on_startup.append(start_fleet)
    app.on_cleanup.append(stop_fleet)
    try:
        # NOTE: a deep accept backlog, so a burst of connections waits for an answer instead of being reset
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, backlog=4096,
                    reuse_port=fronts is not None)
    except WorkerUnavailable as e:
        raise SystemExit(f"mmenc: error: the encoder fleet did not start: {e} (see the log above)") from None
    except EngineUnavailable as e:
        raise SystemExit(f"mmenc: error: the engine did not start: {e} (see the log above)") from None
    except ApiFrontsUnavailable as e:
        raise SystemExit(f"mmenc: error: {e}") from None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
