"""`mmenc bench soak` on the CPU: a tiny server pushed past capacity sheds with 429 + Retry-After and loses
nothing; plus the flatness verdict, outcome classes and the plot on synthetic data."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from aiohttp import web
from PIL import Image

from bench.soak import classify, flatness, main, send
from bench.soak_plot import plot
from tests.server_process import free_port

# NOTE: 2 requests in flight at most, and an arrival rate of 4x what two closed-loop users get answered:
# most requests must be shed with 429 (the gateway's admission limit), none may go unanswered.
SERVER = "--llm none --device cpu --cache-bytes 0 --max-inflight-requests 2 --num-fetch-procs 1"


def test_soak_sheds_past_capacity_and_loses_nothing(tmp_path):
    rc = main(["--start", "--server-args", SERVER, "--mix", "224", "--distinct", "4", "--warmup-s", "1",
               "--warmup-concurrency", "2", "--overload", "4", "--duration", "4", "--interval-s", "0.5",
               "--out-dir", str(tmp_path), "--name", "soak"])
    result = json.loads((tmp_path / "soak.json").read_text())
    by_class = result["by_class"]
    assert rc == 0, result
    assert result["lost"] == 0 and by_class["lost"] == 0
    assert by_class["429"] > 0 and result["missing_retry_after"] == 0  # every 429 carried Retry-After
    assert by_class["2xx"] > 0 and sum(by_class.values()) == result["sent"] > 0
    assert result["rate"] > result["warmup"]["capacity_rps"] > 0
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert result["queue_depth_max"] is not None
    assert {"gateway", "worker0", "worker0.fetch", "total_rss", "shm"} <= set(result["memory"])
    assert result["memory"]["gateway"]["start"] > 0 and result["memory"]["worker0"]["max"] > 0
    phases = [s["phase"] for s in result["samples"]]
    assert {"warmup", "soak", "drain"} <= set(phases) and phases[-1] == "drain"
    with Image.open(tmp_path / "soak.png") as img:
        img.load()
        assert img.size == (960, 640)


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    assert main(["--url", f"http://127.0.0.1:{free_port()}", "--out-dir", str(tmp_path)]) == 2
    assert "/health answered nothing" in capsys.readouterr().err


def test_send_sees_resets_timeouts_and_missing_retry_after():
    """The failures the soak must catch: a 429 without Retry-After, a reset connection, no answer at all."""
    async def shed(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "overloaded"}}, status=429)

    async def reset(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.abort()
        return web.Response()

    async def stall(request: web.Request) -> web.Response:
        await asyncio.sleep(1.5)
        return web.Response()

    async def scenario() -> list:
        app = web.Application()
        app.router.add_post("/shed", shed)
        app.router.add_post("/reset", reset)
        app.router.add_post("/stall", stall)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                now = time.perf_counter()
                return [await send(session, f"{base}/{path}", b"{}", 0.3, now, now)
                        for path in ("shed", "reset", "stall")]
        finally:
            await runner.cleanup()

    shed_out, reset_out, stall_out = asyncio.run(scenario())
    assert (shed_out.cls, shed_out.has_retry_after, shed_out.reason) == ("429", False, "overloaded")
    assert reset_out.cls == "lost" and reset_out.status == 0
    assert (stall_out.cls, stall_out.reason) == ("lost", "client_timeout")


def _samples(worker: list[float]) -> list[dict]:
    return [{"t": float(t), "phase": "soak", "memory_mib": {"gateway": 500.0, "worker0": w},
             "queue_depth": float(t % 3), "inflight_items": t % 5} for t, w in enumerate(worker)]


def test_flatness_verdict():
    flat = flatness(_samples([1000, 1050, 1080, 1060, 1090, 1095]), tol_pct=10, tol_mib=64)
    assert flat["gateway"]["verdict"] == flat["worker0"]["verdict"] == "flat"  # +90 MiB of 1000: within 10 %
    assert flat["worker0"]["start"] == 1000 and flat["worker0"]["end"] == 1090 and flat["worker0"]["max"] == 1095
    grown = flatness(_samples([1000 + 100 * i for i in range(10)]), tol_pct=10, tol_mib=64)
    assert grown["worker0"]["verdict"] == "growing" and grown["worker0"]["growth_mib"] == 800
    assert grown["worker0"]["slope_mib_per_min_2nd_half"] == 6000  # 100 MiB/s
    filled = flatness(_samples([1000, 1300, 1500, 1510, 1500, 1505, 1500]), tol_pct=10, tol_mib=64)
    assert filled["worker0"]["verdict"] == "plateau" and not filled["worker0"]["flat"]  # rose, then held
    assert flatness([], 10, 64) == {}


def test_outcome_classes():
    assert [classify(s) for s in (0, 200, 429, 503, 504, 400, 413, 500, 502)] == [
        "lost", "2xx", "429", "503", "504", "4xx", "4xx", "5xx", "5xx"]


def test_plot_of_synthetic_samples(tmp_path):
    samples = [{**s, "t": s["t"] - 2, "phase": "warmup" if s["t"] < 2 else "soak"}
               for s in _samples([700.0 + i for i in range(12)])]
    path = plot(samples, tmp_path / "p.png", "synthetic", soak_end_t=8.0)
    with Image.open(path) as img:
        assert img.size == (960, 640) and len(img.getcolors(1 << 16) or []) > 3  # more than a blank canvas
