"""A pool of processes (not threads: PIL decode holds the GIL) that fetch and decode media for one worker.

Each child takes one `FetchTask` at a time over its pipe: fetch, header check (pixel limit), then either
the JPEG bytes go back for GPU decode or PIL decodes and the pixels go into the child's arena. Videos are
probed and their sampled frames decoded in parallel chunks (`media_read.read_video`), audio is decoded
and resampled (`media_read.read_audio`); frames / waveform go into the arena the same way. The arena is
one `SharedMemory` segment per child that only the PARENT creates, grows and unlinks (children attach), so a
dying child cannot leak one. The child sends (arena, offset, shape); the dispatcher copies the pixels out
once (pinned when CUDA is available) before that child gets its next task. An image larger than the arena
makes the child ask for a bigger one (`_Grow`) and wait.

The dispatcher thread waits on all child pipes, process sentinels and a wake-up socket; it hands tasks to
idle children, SIGKILLs a child whose task outlives `item_timeout_s`, and replaces children that die.
Only the task a child was running fails.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import hashlib
import itertools
import logging
import math
import multiprocessing
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory

import torch

from preprocess import errors
from preprocess.decode import exif_orientation, is_plain_jpeg, open_image, pil_to_tensor
from preprocess.errors import DecodeError, FetchError, MediaError
from preprocess.fetch import FetchPolicy, fetch_media
from preprocess.media_read import AudioRead, VideoRead, read_audio, read_video

log = logging.getLogger(__name__)

_GPU_JPEG_MODES = ("RGB", "L")  # what both GPU decoders (nvjpeg, DALI mixed) take
_MIN_ARENA_BYTES = 8 << 20  # a 1080p RGB image fits; an arena grows on demand up to 3 * max_source_pixels
_STOP_GRACE_S = 1.0
_MAX_STARTUP_FAILURES = 3  # children in a row that die before they are ready: the pool gives up
_PR_SET_NAME = 15
_ERRORS = {n: c for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, MediaError)}


@dataclass(frozen=True)
class FetchTask:
    """One media item to read."""

    source: str  # URL / local path / "data:" (then `inline` holds the bytes)
    inline: bytes | None = None
    keep_jpeg: bool = False  # the worker decodes JPEGs on the GPU: return plain JPEG bytes undecoded
    video: VideoRead | None = None  # read it as a video: sample and decode frames
    audio: AudioRead | None = None  # read it as audio: decode and resample to 16 kHz mono
    timeout_s: float | None = None  # this task's limit in a child (default: the pool's item_timeout_s)


@dataclass
class FetchResult:
    """What became of one `FetchTask`: exactly one of `image`, `blob`, `frames`, `waveform`, `error` is set."""

    image: torch.Tensor | None  # uint8 [3, H, W] on the CPU
    blob: bytes | None  # compressed bytes, when keep_jpeg and `is_plain_jpeg` said the GPU can take it
    error: MediaError | None
    timings_ms: dict[str, float] = field(default_factory=dict)  # "fetch" and, when decoded here, "decode"
    digest: str = ""  # blake2b-128 of the media bytes (hex), for content-addressed caching
    frames: torch.Tensor | None = None  # video: uint8 [T, H, W, 3], the sampled frames
    waveform: torch.Tensor | None = None  # audio: float32 [N] at 16 kHz
    meta: dict[str, float] = field(default_factory=dict)  # video: "fps" of the sampled frames, "source_fps", ...


# ------------------------------------------------------------------ messages on a child's pipe


@dataclass(frozen=True)
class _Job:  # parent -> child (None asks the child to exit)
    task_id: int
    task: FetchTask


@dataclass(frozen=True)
class _Arena:  # parent -> child: attach this segment and write pixels there from now on
    name: str


@dataclass(frozen=True)
class _Grow:  # child -> parent: the arena is too small for `num_bytes`; answered with an `_Arena`
    num_bytes: int


@dataclass(frozen=True)
class _Done:  # child -> parent: a tensor in the arena (`shape`, `dtype`), bytes (`blob`) or an error
    task_id: int
    timings_ms: dict[str, float]
    arena: str | None = None
    offset: int = 0
    shape: tuple[int, ...] | None = None
    dtype: str = "uint8"
    blob: bytes | None = None
    error: tuple[str, str, str, int] | None = None  # (MediaError class name, message, code, status)
    digest: str = ""
    meta: dict[str, float] = field(default_factory=dict)


_READY = "ready"  # child -> parent, once, after its imports


# ------------------------------------------------------------------ child process


def _child_main(conn: Connection, name: str, arena_name: str, policy: FetchPolicy, max_source_pixels: int,
                is_test: bool) -> None:
    """Child entry point: serve jobs from `conn` until it sends None or the parent goes away."""
    _set_process_name(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    torch.set_num_threads(1)
    # NOTE: spawned children share the parent's resource tracker, so attaching (which registers the name
    # again on Python 3.11) is harmless: the parent's unlink unregisters it once for everybody.
    arena = SharedMemory(arena_name)
    conn.send(_READY)
    try:
        while (job := conn.recv()) is not None:
            done, tensor = _read(job, policy, max_source_pixels, is_test)
            if tensor is not None:
                raw = tensor.contiguous().view(torch.uint8).reshape(-1)  # [num_bytes]
                if raw.numel() > arena.size:
                    conn.send(_Grow(raw.numel()))
                    grown = conn.recv()
                    if not isinstance(grown, _Arena):
                        return
                    arena.close()
                    arena = SharedMemory(grown.name)
                dst = torch.frombuffer(arena.buf, dtype=torch.uint8, count=raw.numel())  # [num_bytes]
                dst.copy_(raw)
                del dst, raw  # NOTE: an exported buffer would make arena.close() fail
                done = _Done(done.task_id, done.timings_ms, arena=arena.name, shape=tuple(tensor.shape),
                             dtype=str(tensor.dtype).removeprefix("torch."), digest=done.digest, meta=done.meta)
            conn.send(done)
            if done.error is not None and done.error[2] == "decode_timeout":
                return  # NOTE: a decoder thread is stuck in this process; exit so the pool starts a fresh one
    except (EOFError, OSError):
        pass  # the parent is gone
    finally:
        arena.close()


def _read(job: _Job, policy: FetchPolicy, max_source_pixels: int, is_test: bool
          ) -> tuple[_Done, torch.Tensor | None]:
    """Fetch + header check + decode (unless the GPU takes the JPEG); never raises."""
    task, timings = job.task, {}
    start = time.perf_counter()
    try:
        if is_test:
            _test_hook(task.source)
        blob = task.inline if task.inline is not None else fetch_media(task.source, policy)
        timings["fetch"] = _ms_since(start)
        digest = hashlib.blake2b(blob, digest_size=16).hexdigest()
        start = time.perf_counter()
        if task.video is not None:
            video = read_video(blob, task.video)
            timings["decode"] = _ms_since(start)
            meta = {"fps": video.fps, "source_frames": float(video.source_frames), "source_fps": video.source_fps}
            return _Done(job.task_id, timings, digest=digest, meta=meta), video.frames
        if task.audio is not None:
            waveform = read_audio(blob, task.audio)
            timings["decode"] = _ms_since(start)
            return _Done(job.task_id, timings, digest=digest), waveform
        img = open_image(blob, max_source_pixels)  # header only: MediaTooLarge before any pixel is decoded
        if task.keep_jpeg and exif_orientation(img) is not None and is_plain_jpeg(blob, img, _GPU_JPEG_MODES):
            return _Done(job.task_id, timings, blob=blob, digest=digest), None
        image = pil_to_tensor(img)  # [3, H, W], a view of [H, W, 3]
        timings["decode"] = _ms_since(start)
        return _Done(job.task_id, timings, digest=digest), image
    except MediaError as e:
        return _Done(job.task_id, timings, error=(type(e).__name__, e.message, e.code, e.status)), None
    except Exception as e:  # a decoder bug fails its item with a 500; the traceback stays in our log
        log.exception("unexpected failure reading %.200s", task.source)
        message = f"internal error while reading media: {type(e).__name__}"
        return _Done(job.task_id, timings, error=("MediaError", message, "internal", 500)), None


def _test_hook(source: str) -> None:
    """Misbehaviours for tests, only with `FetchPool(..., _test_hooks=True)`."""
    if source == "test:segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif source == "test:exit":
        os._exit(3)
    elif source == "test:raise":
        raise RuntimeError("boom")


def _set_process_name(name: str) -> None:
    """Name this process for `ps -o comm`/`top` (Linux, 15 characters) and for log lines."""
    multiprocessing.current_process().name = name
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


# ------------------------------------------------------------------ parent side


@dataclass
class _Pending:
    task_id: int
    task: FetchTask
    callback: Callable[[FetchResult], None]


@dataclass(eq=False)
class _Child:
    """One child process as the dispatcher sees it."""

    index: int
    process: multiprocessing.process.BaseProcess
    conn: Connection
    arena: SharedMemory  # created and unlinked by the parent only
    is_ready: bool = False
    job: _Pending | None = None
    deadline: float = math.inf  # monotonic; when the running job times out


class FetchPool:
    """Processes that fetch and decode media for one worker; results arrive through callbacks.

    Args:
        num_procs: child processes (each holds at most one task at a time).
        policy: what may be fetched and how much of it.
        max_source_pixels: largest accepted width * height (checked from the header, before decoding).
        item_timeout_s: limit per task from the moment a child takes it (unless the task sets its own);
            past it the child is killed.
        name: process name prefix; children are named f"{name}-{i}".
        max_result_bytes: largest decoded result (image pixels, video frames, waveform) a child may hand
            over; default 3 * max_source_pixels (one RGB image).
    """

    def __init__(self, num_procs: int, policy: FetchPolicy, max_source_pixels: int, item_timeout_s: float,
                 name: str = "mmenc-fetch", *, max_result_bytes: int = 0, _test_hooks: bool = False) -> None:
        if num_procs < 1 or max_source_pixels < 1 or item_timeout_s <= 0:
            raise ValueError("need num_procs >= 1, max_source_pixels >= 1 and item_timeout_s > 0")
        self._ctx = multiprocessing.get_context("spawn")
        self._policy, self._max_source_pixels, self._item_timeout_s = policy, max_source_pixels, item_timeout_s
        self._name, self._is_test = name, _test_hooks
        self._max_arena_bytes = max(3 * max_source_pixels, max_result_bytes)
        self._pin = torch.cuda.is_available()
        self._lock = threading.Lock()  # guards `_submitted` and `_is_closing`
        self._submitted: collections.deque[_Pending] = collections.deque()
        self._is_closing = False
        self._task_ids = itertools.count()
        self._queue: collections.deque[_Pending] = collections.deque()  # dispatcher only, like all below
        self._num_restarts = 0
        self._num_startup_failures = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._children: list[_Child] = []
        self._all_ready = threading.Event()  # every child has started once (imports done)
        try:
            for i in range(num_procs):
                self._children.append(self._start_child(i, self._new_arena(min(_MIN_ARENA_BYTES,
                                                                                self._max_arena_bytes))))
        except BaseException:
            self._shutdown()
            raise
        self._thread = threading.Thread(target=self._run, name=f"{name}-dispatch", daemon=True)
        self._thread.start()

    def submit(self, task: FetchTask, callback: Callable[[FetchResult], None]) -> None:
        """Queue `task`; `callback(result)` runs later, exactly once, on the pool's dispatcher thread.

        Thread-safe and non-blocking. The callback must be quick (e.g. put on a queue). Tasks still
        pending at `close()` are called back with an error. Raises RuntimeError once the pool is closed.
        """
        with self._lock:
            if self._is_closing:
                raise RuntimeError("FetchPool is closed")
            self._submitted.append(_Pending(next(self._task_ids), task, callback))
        self._wake()

    def close(self) -> None:
        """Stop the children, fail what is still pending, unlink every shared-memory segment. Idempotent."""
        with self._lock:
            self._is_closing = True
        self._wake()
        if threading.current_thread() is not self._thread:  # from a callback: the loop ends after it
            self._thread.join()

    def __enter__(self) -> FetchPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until every child has finished starting (its imports), so the first items do not wait for
        them; False if that takes longer than `timeout_s`."""
        return self._all_ready.wait(timeout_s)

    @property
    def num_alive(self) -> int:
        """Child processes currently alive."""
        # NOTE: a look at the sentinel, not is_alive(): that reaps, and would race with the dispatcher's join
        return sum(not wait([child.process.sentinel], 0) for child in list(self._children))

    @property
    def num_restarts(self) -> int:
        """Children replaced after a crash or a timeout."""
        return self._num_restarts

    # -------------------------------------------------------------- dispatcher thread

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._is_closing:
                        break
                    self._queue.extend(self._submitted)
                    self._submitted.clear()
                self._assign()
                live = [c for c in self._children if not c.conn.closed]
                by_handle = {h: c for c in live for h in (c.conn, c.process.sentinel)}
                deadline = min((c.deadline for c in self._children), default=math.inf)
                timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
                ready = wait([self._wake_r, *by_handle], timeout)
                if self._wake_r in ready:
                    self._drain_wake()
                for child in {by_handle[h] for h in ready if h in by_handle}:
                    self._service(child, is_dead=child.process.sentinel in ready)
                now = time.monotonic()
                for child in [c for c in self._children if c.deadline <= now]:
                    limit = (child.job.task.timeout_s if child.job else None) or self._item_timeout_s
                    self._replace(child, FetchError(f"timed out after {limit:g} s reading media"))
        except Exception:
            log.exception("fetch pool dispatcher failed")
        finally:
            self._shutdown()

    def _assign(self) -> None:
        """Give queued tasks to idle, ready children (or fail them all when children cannot start)."""
        if self._num_startup_failures >= _MAX_STARTUP_FAILURES:
            error = MediaError("fetch processes cannot start", code="internal", status=500)
            while self._queue:
                self._finish(self._queue.popleft(), FetchResult(None, None, error))
            return
        for child in self._children:
            if not self._queue:
                return
            if child.is_ready and child.job is None:
                job = self._queue.popleft()
                try:
                    child.conn.send(_Job(job.task_id, job.task))
                except OSError:  # died while idle: the task never started, so it goes back in front
                    self._queue.appendleft(job)
                    self._replace(child, None)
                    continue
                child.job, child.deadline = job, time.monotonic() + (job.task.timeout_s or self._item_timeout_s)

    def _service(self, child: _Child, is_dead: bool) -> None:
        """Handle everything `child` sent; replace it when it has died."""
        try:
            while not child.conn.closed and child.conn.poll():
                self._on_message(child, child.conn.recv())
        except Exception:  # EOF, or a message cut short by the child's death
            is_dead = True
        if is_dead:
            child.process.join(_STOP_GRACE_S)  # its pipe closed first: it is exiting; learn how
            code = child.process.exitcode
            why = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            self._replace(child, DecodeError(f"decoder process crashed ({why}) while reading this media"))

    def _on_message(self, child: _Child, msg: object) -> None:
        if msg == _READY:
            child.is_ready, self._num_startup_failures = True, 0
            if all(c.is_ready for c in self._children):
                self._all_ready.set()
        elif isinstance(msg, _Grow):
            old = child.arena
            child.arena = self._new_arena(max(msg.num_bytes, min(2 * old.size, self._max_arena_bytes)))
            child.conn.send(_Arena(child.arena.name))
            _free_arena(old)  # the child still maps it until it attaches the new one; unlink is fine
        elif isinstance(msg, _Done) and child.job is not None and msg.task_id == child.job.task_id:
            job, child.job, child.deadline = child.job, None, math.inf
            try:
                result = self._result(child, msg)
            except Exception as e:  # e.g. out of (pinned) memory: fail the item, not the pool
                log.exception("cannot take the result of %s", child.process.name)
                error = MediaError(f"internal error while reading media: {type(e).__name__}", code="internal",
                                   status=500)
                result = FetchResult(None, None, error, msg.timings_ms)
            self._finish(job, result)
        else:
            raise RuntimeError(f"unexpected message from {child.process.name}: {msg!r:.100}")

    def _result(self, child: _Child, done: _Done) -> FetchResult:
        if done.error is not None:
            kind, message, code, status = done.error
            error = _ERRORS.get(kind, MediaError)(message, code=code, status=status)
            return FetchResult(None, None, error, done.timings_ms)
        if done.shape is None:
            return FetchResult(None, done.blob, None, done.timings_ms, done.digest)
        if done.arena != child.arena.name:
            raise RuntimeError(f"{child.process.name} wrote to {done.arena}, not its arena {child.arena.name}")
        start = time.perf_counter()
        dtype = getattr(torch, done.dtype)
        num_bytes = math.prod(done.shape) * dtype.itemsize
        src = torch.frombuffer(child.arena.buf, dtype=torch.uint8, count=num_bytes, offset=done.offset)  # shm
        # NOTE: only images are pinned: pinning a video's GBs costs more than the faster upload saves
        out = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self._pin and len(done.shape) == 3)  # [num_bytes]
        out.copy_(src)
        del src  # NOTE: an exported buffer would make the arena's close() fail
        tensor = out.view(dtype).view(done.shape)
        timings = {**done.timings_ms, "decode": done.timings_ms.get("decode", 0.0) + _ms_since(start)}
        if len(done.shape) == 4:
            return FetchResult(None, None, None, timings, done.digest, frames=tensor, meta=done.meta)
        if len(done.shape) == 1:
            return FetchResult(None, None, None, timings, done.digest, waveform=tensor, meta=done.meta)
        return FetchResult(tensor, None, None, timings, done.digest)

    def _replace(self, child: _Child, error: MediaError | None) -> None:
        """Kill `child`, fail its task with `error`, start a new child on the same arena."""
        child.process.kill()
        child.process.join()
        child.conn.close()
        if not child.is_ready:
            self._num_startup_failures += 1
            log.error("%s died while starting (exit code %s)", child.process.name, child.process.exitcode)
        elif error is not None:
            log.warning("%s replaced: %s", child.process.name, error.message)
        if self._num_startup_failures < _MAX_STARTUP_FAILURES:
            self._children[child.index] = self._start_child(child.index, child.arena)
            self._num_restarts += 1
        if child.job is not None:
            self._finish(child.job, FetchResult(None, None, error or DecodeError("decoder process died")))
            child.job, child.deadline = None, math.inf

    def _start_child(self, index: int, arena: SharedMemory) -> _Child:
        parent_end, child_end = self._ctx.Pipe()
        name = f"{self._name}-{index}"
        process = self._ctx.Process(target=_child_main, name=name, daemon=True, args=(
            child_end, name, arena.name, self._policy, self._max_source_pixels, self._is_test))
        # NOTE: multiprocessing refuses children of a daemonic process (the fleet's workers are) lest they
        # outlive it; ours exit at EOF on their pipe, i.e. after at most one task once the worker is gone.
        me = multiprocessing.current_process()
        was_daemon, me.daemon = me.daemon, False
        try:
            process.start()
        finally:
            me.daemon = was_daemon
        child_end.close()
        return _Child(index, process, parent_end, arena)

    def _new_arena(self, size: int) -> SharedMemory:
        return SharedMemory(f"{self._name}-{os.getpid()}-{secrets.token_hex(6)}", create=True, size=size)

    def _finish(self, job: _Pending, result: FetchResult) -> None:
        try:
            job.callback(result)
        except Exception:
            log.exception("fetch callback failed")

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # buffer full (a wake-up is pending anyway) or already closed
            self._wake_w.send(b"\0")

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass

    def _shutdown(self) -> None:
        """Stop children (idle ones politely, busy ones at once), fail pending tasks, free all segments."""
        with self._lock:
            self._is_closing = True
            self._queue.extend(self._submitted)
            self._submitted.clear()
        for child in self._children:
            if child.job is not None:
                child.process.kill()
                continue
            with contextlib.suppress(OSError):
                child.conn.send(None)
        stop_by = time.monotonic() + _STOP_GRACE_S
        for child in self._children:
            child.process.join(max(0.0, stop_by - time.monotonic()))
            if child.process.is_alive():
                child.process.kill()
                child.process.join()
            child.conn.close()
            _free_arena(child.arena)
            if child.job is not None:
                self._queue.append(child.job)
        error = MediaError("the fetch pool was closed before this item was read", code="unavailable", status=503)
        while self._queue:
            self._finish(self._queue.popleft(), FetchResult(None, None, error))
        self._wake_r.close()
        self._wake_w.close()


def _free_arena(arena: SharedMemory) -> None:
    arena.close()
    arena.unlink()


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
