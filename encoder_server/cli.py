"""The `mmenc` command: `serve`, `embed FILE...`, `cache stats|clear`, `bench NAME`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from encoder_server.config import PreprocessConfig, ServerArgs, WorkerConfig, add_config_args, config_from_args


def _serve(ns: argparse.Namespace) -> int:
    import tempfile

    from encoder_server.logs import enable_multiprocess_metrics

    args = config_from_args(ServerArgs, ns)
    run_dir = Path(tempfile.mkdtemp(prefix="mmenc-"))
    enable_multiprocess_metrics(run_dir / "metrics")  # before anything imports prometheus_client
    from encoder_server.serve import serve

    serve(args, run_dir)
    return 0


def _embed(ns: argparse.Namespace) -> int:
    """Encode local image files in this process and print one line per file."""
    import torch

    from encoder_server.models.loader import load_vision, resolve_device, resolve_dtype
    from preprocess.decode import decode_images, resolve_backend
    from preprocess.errors import MediaError
    from preprocess.image import preprocess_images

    worker: WorkerConfig = config_from_args(WorkerConfig, ns)
    prep: PreprocessConfig = config_from_args(PreprocessConfig, ns)
    device = resolve_device(worker.device)
    dtype = resolve_dtype(worker.dtype, device)
    loaded = load_vision(worker.vision_model, device, dtype)
    backend = resolve_backend(prep.decode_backend, device)
    failed = 0
    for path in ns.files:
        start = time.perf_counter()
        try:
            blob = Path(path).read_bytes()
            image = decode_images([blob], backend, device, prep.max_source_pixels)[0]
            if isinstance(image, MediaError):
                raise image
            batch = preprocess_images([image], prep, device, out_dtype=dtype)
            with torch.inference_mode():
                out = loaded.model(batch.pixel_values, batch.grid_thw)  # [tokens, D]
        except (OSError, MediaError) as e:
            print(f"{path}: error: {e}", file=sys.stderr)
            failed += 1
            continue
        grid = tuple(batch.grid_thw[0].tolist())
        ms = (time.perf_counter() - start) * 1e3
        print(f"{path}: grid_thw={grid} shape={tuple(out.shape)} norm={out.float().norm():.4f} "
              f"mean_norm={out.float().mean(0).norm():.4f} ({ms:.1f} ms)")
    return 1 if failed else 0


def _cache(ns: argparse.Namespace) -> int:
    """Inspect or drop the machine-wide embedding caches (one arena per model, /dev/shm/mmenc-cache-*)."""
    import json

    from cache.shm import ShmEmbeddingCache

    names = [ns.name] if ns.name else sorted({p.name for p in Path("/dev/shm").glob("mmenc-cache-*")
                                              if ShmEmbeddingCache.exists(p.name)})
    if not names:
        print("no mmenc cache arena on this machine")
        return 0
    for name in names:
        try:
            arena = ShmEmbeddingCache(name, 0, create=False)
        except FileNotFoundError:
            print(f"mmenc: error: no cache arena named {name!r}", file=sys.stderr)
            return 1
        if ns.action == "clear":
            arena.clear()
            if ns.unlink:
                arena.unlink()
            print(f"{name}: {'removed' if ns.unlink else 'cleared'}")
        else:
            print(json.dumps({"name": name, **arena.stats()}))
        arena.close()
    return 0


# `mmenc bench NAME` -> the module whose `main(argv)` runs it (imported only when chosen)
BENCHES = {"vit": "bench.vit", "preprocess": "bench.preprocess", "serve": "bench.serve", "cache": "bench.cache",
           "video": "bench.video", "audio": "bench.audio", "engine": "bench.engine",
           "engine-prefix": "bench.engine_prefix", "soak": "bench.soak", "chat": "bench.chat",
           "video-serve": "bench.video_serve", "response": "bench.response", "loop-stall": "bench.loop_stall",
           "engine-ops": "bench.engine_ops"}


def _bench(ns: argparse.Namespace, rest: list[str]) -> int:
    import importlib

    return importlib.import_module(BENCHES[ns.what]).main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmenc", description="Multimodal encoder server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the gateway and an encoder worker on this machine")
    add_config_args(serve, ServerArgs)
    embed = sub.add_parser("embed", help="encode local image files and print shape and norm")
    embed.add_argument("files", nargs="+")
    add_config_args(embed, WorkerConfig)
    add_config_args(embed, PreprocessConfig)
    cache = sub.add_parser("cache", help="inspect (stats) or drop (clear) the machine-wide embedding cache")
    cache.add_argument("action", choices=["stats", "clear"])
    cache.add_argument("--name", default=None, help="arena name (default: every mmenc cache on this machine)")
    cache.add_argument("--unlink", action="store_true", help="with clear: also remove the arena itself")
    bench = sub.add_parser("bench", help="benchmarks (run on a GPU machine); `mmenc bench vit --help`")
    bench.add_argument("what", choices=sorted(BENCHES))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    ns, rest = parser.parse_known_args(argv)
    if ns.command == "bench":
        return _bench(ns, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if ns.command == "serve":
            return _serve(ns)
        if ns.command == "cache":
            return _cache(ns)
        return _embed(ns)
    except ValueError as e:  # configuration errors: one clear line, no traceback
        print(f"mmenc: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
