"""preprocess.fetch_pool: child processes fetch + decode, pixels come back through shared memory.

One pool serves most of the module (children start in ~2 s each on a small machine); tests that close a
pool start their own.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch
from PIL import Image

from preprocess.decode import decode_images
from preprocess.errors import DecodeError, FetchError, ForbiddenSource, MediaError, MediaTooLarge
from preprocess.fetch import FetchPolicy
from preprocess.fetch_pool import FetchPool, FetchResult, FetchTask

try:
    from tests.media_server import MediaServer
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from media_server import MediaServer

MAX_PIXELS = 1_000_000
POLICY = FetchPolicy(timeout_s=5.0, allow_private=True)
POOL_NAME = "mmenc-tfp"


def _encode(img: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


@pytest.fixture(scope="module")
def images(sample_photos: list[np.ndarray]) -> dict[str, bytes]:
    photo = Image.fromarray(sample_photos[0])  # [427, 640, 3]
    rgba = Image.fromarray(np.dstack([sample_photos[1][:200, :300], np.full((200, 300), 128, np.uint8)]))
    return {
        "jpeg": _encode(photo, "JPEG", quality=90),
        "png": _encode(photo, "PNG"),
        "rgba_png": _encode(rgba, "PNG"),
        "cmyk_jpeg": _encode(photo.convert("CMYK"), "JPEG"),
        "huge_png": _encode(Image.new("1", (1200, 1000)), "PNG"),  # 1.2 MP > MAX_PIXELS, a few hundred bytes
        "text": b"hello, this is not an image\n" * 10,
    }


@pytest.fixture(scope="module")
def srv(images: dict[str, bytes]) -> Iterator[MediaServer]:
    with MediaServer({f"/{k}": v for k, v in images.items()}) as server:
        yield server


@pytest.fixture(scope="module")
def pool() -> Iterator[FetchPool]:
    with FetchPool(2, POLICY, MAX_PIXELS, item_timeout_s=1.0, name=POOL_NAME, _test_hooks=True) as p:
        yield p


def run_all(pool: FetchPool, tasks: list[FetchTask], timeout_s: float = 30.0) -> list[FetchResult]:
    """Submit every task at once; wait for all callbacks; results in task order."""
    results: list[FetchResult | None] = [None] * len(tasks)
    num_calls = [0] * len(tasks)
    done = threading.Semaphore(0)

    def callback_for(i: int) -> Callable[[FetchResult], None]:
        def callback(result: FetchResult) -> None:
            num_calls[i] += 1
            results[i] = result
            done.release()
        return callback

    for i, task in enumerate(tasks):
        pool.submit(task, callback_for(i))
    for _ in tasks:
        assert done.acquire(timeout=timeout_s), "a callback never came"
    assert num_calls == [1] * len(tasks)
    return results  # type: ignore[return-value]


def shm_segments(prefix: str = "") -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def image_of(result: FetchResult) -> torch.Tensor:
    assert result.error is None and result.blob is None, result.error
    assert result.image is not None
    return result.image


# ------------------------------------------------------------------ decoding


@pytest.mark.parametrize("kind", ["jpeg", "png", "rgba_png", "cmyk_jpeg"])
def test_pixels_equal_in_process_decode(pool: FetchPool, srv: MediaServer, images: dict[str, bytes],
                                        kind: str) -> None:
    expected = decode_images([images[kind]], "pil", "cpu", MAX_PIXELS)[0]
    assert isinstance(expected, torch.Tensor)
    by_url, inline = run_all(pool, [FetchTask(srv.url(f"/{kind}")), FetchTask("data:", images[kind])])
    for result in (by_url, inline):
        image = image_of(result)  # [3, H, W]
        assert image.dtype == torch.uint8 and image.is_contiguous() and image.device.type == "cpu"
        assert torch.equal(image, expected)
        assert set(result.timings_ms) == {"fetch", "decode"}


def test_keep_jpeg_returns_bytes_only_for_plain_jpegs(pool: FetchPool, images: dict[str, bytes]) -> None:
    jpeg, png, cmyk = run_all(pool, [FetchTask("data:", images[k], keep_jpeg=True)
                                     for k in ("jpeg", "png", "cmyk_jpeg")])
    assert jpeg.blob == images["jpeg"] and jpeg.image is None and jpeg.error is None
    assert "decode" not in jpeg.timings_ms
    assert image_of(png).shape == (3, 427, 640)
    assert image_of(cmyk).shape == (3, 427, 640)  # CMYK: not for the GPU decoders, decoded here


def test_concurrent_submits_from_threads(pool: FetchPool, images: dict[str, bytes]) -> None:
    calls: Counter[int] = Counter()
    outcomes: dict[int, bool] = {}
    lock, all_done = threading.Lock(), threading.Event()
    num_threads, per_thread = 4, 20

    def submitter(t: int) -> None:
        for j in range(per_thread):
            key = t * per_thread + j
            blob = images["text"] if key % 5 == 0 else images["rgba_png"]

            def callback(result: FetchResult, key: int = key) -> None:
                with lock:
                    calls[key] += 1
                    outcomes[key] = result.error is None
                    if len(calls) == num_threads * per_thread:
                        all_done.set()

            pool.submit(FetchTask("data:", blob), callback)

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all_done.wait(30)
    run_all(pool, [FetchTask("data:", images["jpeg"])])  # anything queued behind has run by now
    assert set(calls.values()) == {1}
    assert outcomes == {k: k % 5 != 0 for k in range(num_threads * per_thread)}


def test_children_reuse_http_connections(pool: FetchPool, images: dict[str, bytes]) -> None:
    with MediaServer({"/png": images["png"]}, keep_alive=True) as server:
        results = run_all(pool, [FetchTask(server.url("/png"))] * 6)
        assert all(image_of(r).shape == (3, 427, 640) for r in results)
        assert server.num_connections <= 2  # one per child at most


def test_wait_ready_returns_once_children_started() -> None:
    start = time.monotonic()
    with FetchPool(2, POLICY, MAX_PIXELS, item_timeout_s=10.0, name="mmenc-tfp-ready") as fresh:
        assert fresh.wait_ready(60) and fresh.num_alive == 2
        assert fresh.wait_ready(0)  # stays true
    assert time.monotonic() - start < 60


def test_children_are_named(pool: FetchPool) -> None:
    names = set()
    for child in multiprocessing.active_children():
        if child.name.startswith(POOL_NAME):
            with open(f"/proc/{child.pid}/comm") as f:
                names.add(f.read().strip())
    assert names == {f"{POOL_NAME}-0", f"{POOL_NAME}-1"}


def _pool_in_daemon(blob: bytes, out: Connection) -> None:
    with FetchPool(1, POLICY, MAX_PIXELS, item_timeout_s=10.0, name="mmenc-tfp-daemon") as pool:
        out.send(tuple(image_of(run_all(pool, [FetchTask("data:", blob)])[0]).shape))


def test_pool_inside_a_daemonic_process(images: dict[str, bytes]) -> None:
    """The fleet starts its workers as daemons, whose children multiprocessing refuses by default."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_pool_in_daemon, args=(images["png"], sender), daemon=True)
    proc.start()
    assert receiver.poll(60), f"no answer (exit code {proc.exitcode})"
    assert receiver.recv() == (3, 427, 640)
    proc.join(10)
    assert proc.exitcode == 0


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(("source", "kind", "error", "status", "message"), [
    ("/status/404", None, FetchError, 400, "HTTP 404"),
    ("/text", None, DecodeError, 415, "not an image"),
    ("/huge_png", None, MediaTooLarge, 413, "1200x1000 = 1200000 pixels"),
    ("data:", "text", DecodeError, 415, "not an image"),
    ("gopher://example.com/a.jpg", None, ForbiddenSource, 403, "scheme 'gopher' is not allowed"),
    ("test:raise", None, MediaError, 500, "internal error while reading media: RuntimeError"),
])
def test_errors_keep_their_class(pool: FetchPool, srv: MediaServer, images: dict[str, bytes], source: str,
                                 kind: str | None, error: type[MediaError], status: int, message: str) -> None:
    if source.startswith("/"):
        source = srv.url(source)
    (result,) = run_all(pool, [FetchTask(source, images[kind] if kind else None, keep_jpeg=True)])
    assert result.image is None and result.blob is None
    assert type(result.error) is error and result.error.status == status
    assert message in result.error.message and "Traceback" not in result.error.message
    if status == 500:
        assert result.error.code == "internal"


def test_stalled_url_times_out_alone(pool: FetchPool, srv: MediaServer, images: dict[str, bytes]) -> None:
    restarts = pool.num_restarts
    start = time.monotonic()
    stalled, *others = run_all(pool, [FetchTask(srv.url("/stall"))] + [FetchTask(srv.url("/png"))] * 6)
    assert isinstance(stalled.error, FetchError) and "timed out after 1 s" in stalled.error.message
    assert time.monotonic() - start < 4
    for result in others:
        assert image_of(result).shape == (3, 427, 640)
    assert pool.num_restarts == restarts + 1
    assert image_of(run_all(pool, [FetchTask(srv.url("/jpeg"))])[0]).shape == (3, 427, 640)


@pytest.mark.parametrize(("source", "why"), [("test:segv", "signal SIGSEGV"), ("test:exit", "exit code 3")])
def test_crashing_child_fails_only_its_task(pool: FetchPool, images: dict[str, bytes], source: str,
                                            why: str) -> None:
    restarts, segments = pool.num_restarts, shm_segments(POOL_NAME)
    assert len(segments) == 2  # one arena per child
    crashed, *others = run_all(pool, [FetchTask(source)] + [FetchTask("data:", images["jpeg"])] * 4)
    assert isinstance(crashed.error, DecodeError)
    assert f"decoder process crashed ({why})" in crashed.error.message
    assert all(image_of(r).shape == (3, 427, 640) for r in others)
    assert pool.num_restarts == restarts + 1
    assert image_of(run_all(pool, [FetchTask("data:", images["png"])] * 2)[1]).shape == (3, 427, 640)
    assert pool.num_alive == 2
    assert shm_segments(POOL_NAME) == segments  # the replacement child took over the parent's arena


# ------------------------------------------------------------------ lifecycle


def test_grow_close_and_no_leftovers(srv: MediaServer) -> None:
    big = _encode(Image.new("RGB", (2400, 1600), (10, 200, 30)), "PNG")  # 11.5 MB decoded > 8 MiB arena
    pool = FetchPool(1, POLICY, 64_000_000, item_timeout_s=30.0, name="mmenc-tfp-close")
    grown, again = run_all(pool, [FetchTask("data:", big)] * 2)
    assert torch.equal(image_of(grown), decode_images([big])[0]) and torch.equal(image_of(again), image_of(grown))
    assert len(shm_segments("mmenc-tfp-close")) == 1  # grown in place of the old one

    cut: list[FetchResult] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:  # accepts, never answers
        listener.settimeout(10)
        pool.submit(FetchTask(f"http://127.0.0.1:{listener.getsockname()[1]}/a.png"), cut.append)
        for _ in range(3):
            pool.submit(FetchTask(srv.url("/png")), cut.append)  # queued behind the stalled one
        conn, _ = listener.accept()  # the child is in the middle of its task
        pool.close()
        conn.close()
    assert len(cut) == 4
    assert all(r.error is not None and r.error.status == 503 for r in cut)
    assert pool.num_alive == 0
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("mmenc-tfp-close")]
    assert not shm_segments("mmenc-tfp-close")
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(FetchTask("data:", big), cut.append)


class _PolicyThatCannotArrive(FetchPolicy):
    """Unpickles as int("not a policy"): every child dies while starting."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return int, ("not a policy",)


def test_children_that_cannot_start_are_not_restarted_forever() -> None:
    with FetchPool(3, _PolicyThatCannotArrive(), MAX_PIXELS, item_timeout_s=5.0, name="mmenc-tfp-broken") as pool:
        (result,) = run_all(pool, [FetchTask("data:", b"x")])
        assert result.error is not None and result.error.status == 500
        assert "cannot start" in result.error.message
        assert pool.num_restarts <= 2
    assert pool.num_alive == 0 and not shm_segments("mmenc-tfp-broken")
