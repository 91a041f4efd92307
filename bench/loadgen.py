"""Load generation for `mmenc bench serve`: closed loop (N virtual users) or open loop (Poisson arrivals).

Every request ends in a `RequestRecord`: an answer, an HTTP error (status + the error body's `code`), or
a client-side failure (status 0: `client_timeout`, `connection_error`, ...). Nothing waits longer than
the client timeout, so a run ends at most `timeout_s` after its last request was sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# One request's body: (JSON bytes, number of images in it).
BodyFactory = Callable[[], tuple[bytes, int]]


@dataclass
class RequestRecord:
    """What happened to one request. `latency_s` runs from the intended send time to the last byte."""

    sent_at: float  # time.perf_counter() when the request was due
    latency_s: float
    status: int  # HTTP status; 0 when no HTTP answer came
    code: str | None  # None on success; else the error body's `code` or a client-side class
    num_images: int
    num_tokens: int = 0
    item_timings: list[dict[str, float]] = field(default_factory=list)
    gateway_timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.code is None


def _error_code(status: int, raw: bytes) -> str:
    try:
        code = json.loads(raw)["error"]["code"]
        return str(code) if code else f"http_{status}"
    except (ValueError, KeyError, TypeError):
        return f"http_{status}"


CLIENT_FAILURES = (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError)  # a request's own failures


def failure_code(exc: BaseException) -> str:
    """The error class a load generator records for one of CLIENT_FAILURES (or a malformed answer)."""
    if isinstance(exc, TimeoutError):
        return "client_timeout"
    if isinstance(exc, aiohttp.ClientConnectionError):
        return "connection_error"
    if isinstance(exc, aiohttp.ClientError):
        return "client_error"
    return "bad_response"


def without_embedding_strings(raw: bytes) -> bytes:
    """`raw` with every `"embedding": "<base64>"` value emptied: the load generator reads only token counts and
    timings, and parsing a 7B-size image's 14 MB of base64 into a str would cost it ~8 ms per image (a client
    bottleneck at the rates a fleet serves). Float lists are left as they are."""
    out, pos, key = [], 0, b'"embedding":'
    while (start := raw.find(key, pos)) >= 0:
        value = start + len(key)
        while value < len(raw) and raw[value] in b" \t\r\n":
            value += 1
        if value >= len(raw) or raw[value] != ord('"'):
            out.append(raw[pos:value])
            pos = value
            continue
        end = raw.find(b'"', value + 1)  # base64 has no quote or backslash
        if end < 0:
            break
        out.append(raw[pos:value + 1])
        pos = end
    out.append(raw[pos:])
    return b"".join(out)


async def send_one(session: aiohttp.ClientSession, url: str, body: bytes, num_images: int, timeout_s: float,
                   sent_at: float | None = None) -> RequestRecord:
    """POST `body` to `url` and classify the outcome; never raises for network or HTTP errors."""
    sent_at = time.perf_counter() if sent_at is None else sent_at
    rec = RequestRecord(sent_at, 0.0, 0, None, num_images)
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            rec.status = resp.status
        if rec.status != 200:
            rec.code = _error_code(rec.status, raw)
        else:
            answer = json.loads(without_embedding_strings(raw))
            rec.num_tokens = sum(int(d.get("num_tokens", 0)) for d in answer["data"])
            rec.item_timings = [d.get("timings_ms") or {} for d in answer["data"]]
            rec.gateway_timings = answer.get("timings_ms") or {}
    except CLIENT_FAILURES as e:
        rec.code = failure_code(e)
    rec.latency_s = time.perf_counter() - sent_at
    return rec


class Progress:
    """One status line on stderr, rewritten at most `hz` times a second (plain lines when not a terminal)."""

    def __init__(self, label: str, enabled: bool = True, hz: float = 5.0) -> None:
        self.label, self.enabled = label, enabled
        self.is_tty = sys.stderr.isatty()
        self.interval = 1.0 / hz if self.is_tty else 10.0
        self.start = time.perf_counter()
        self.num_done = self.num_errors = self.num_in_flight = 0
        self._task: asyncio.Task[None] | None = None

    def record(self, rec: RequestRecord) -> None:
        self.num_done += 1
        self.num_errors += not rec.ok

    def _line(self) -> str:
        elapsed = time.perf_counter() - self.start
        rps = self.num_done / elapsed if elapsed > 0 else 0.0
        return (f"[{self.label}] {elapsed:5.1f} s  {self.num_done} done  {rps:.1f} req/s  "
                f"{self.num_errors} errors  {self.num_in_flight} in flight")

    def _write(self, final: bool = False) -> None:
        if self.is_tty:
            sys.stderr.write("\r\x1b[2K" + self._line() + ("\n" if final else ""))
        else:
            sys.stderr.write(self._line() + "\n")
        sys.stderr.flush()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self._write()

    def __enter__(self) -> Progress:
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            self._write(final=True)


@dataclass(frozen=True)
class LoadSpec:
    """One load phase: `concurrency` users (closed loop) or `rate` requests/s (open loop), bounded by
    `duration_s` and/or `num_requests` (whichever comes first)."""

    url: str
    concurrency: int | None = None
    rate: float | None = None
    duration_s: float | None = None
    num_requests: int | None = None
    timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) and rate (open loop)")
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("a load phase needs a duration or a request count")
        if (self.concurrency or 1) < 1 or (self.rate is not None and self.rate <= 0):
            raise ValueError("concurrency must be >= 1 and rate > 0")


async def run_load(session: aiohttp.ClientSession, spec: LoadSpec, make_body: BodyFactory,
                   progress: Progress) -> tuple[list[RequestRecord], float]:
    """Run one phase; returns every request's record and the wall time from start to the last answer."""
    start = time.perf_counter()
    deadline = start + spec.duration_s if spec.duration_s is not None else math.inf
    budget = spec.num_requests if spec.num_requests is not None else math.inf
    records: list[RequestRecord] = []

    async def send(body: bytes, num_images: int, sent_at: float | None = None) -> None:
        progress.num_in_flight += 1
        rec = await send_one(session, spec.url, body, num_images, spec.timeout_s, sent_at)
        progress.num_in_flight -= 1
        progress.record(rec)
        records.append(rec)

    if spec.concurrency is not None:
        issued = 0

        async def user() -> None:
            nonlocal issued
            while time.perf_counter() < deadline and issued < budget:
                issued += 1
                await send(*make_body())

        await asyncio.gather(*(user() for _ in range(spec.concurrency)))
    else:
        assert spec.rate is not None
        rng = random.Random(spec.seed)
        tasks: list[asyncio.Task[None]] = []
        due = start
        while len(tasks) < budget:
            due += rng.expovariate(spec.rate)  # Poisson arrivals: exponential gaps
            if due > deadline:
                break
            body, num_images = make_body()
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(send(body, num_images, sent_at=due)))
        await asyncio.gather(*tasks)
    end = max((r.sent_at + r.latency_s for r in records), default=time.perf_counter())
    return records, end - start


async def get_text(session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    """(status, body text) of a GET; (0, reason) when the server cannot be reached."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status, await resp.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        return 0, f"{type(e).__name__}: {e}"


def json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
