"""The router's signal scraper against a ``/metrics`` served the way vLLM
serves it: prometheus_client's own exposition code over a registry with
vLLM's families, the connector's, and a large family the router never
reads. The scraper asks for the samples it reads alone, and still gets
every signal."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
    make_wsgi_app,
)

from kvpush.router.scraper import SignalScraper
from kvpush.router.signals import SignalBoard, parse_scrape
from kvpush.topology import Backend

LABELS = ("model_name", "engine")


def vllm_registry() -> CollectorRegistry:
    """One engine with 3 running, 1 waiting, a quarter of its KV in use, a
    decode peer's handovers and bytes in flight, and a histogram with many
    buckets that no signal needs (vLLM has dozens like it)."""
    reg = CollectorRegistry()
    gauges = {
        "vllm:num_requests_running": 3,
        "vllm:num_requests_waiting": 1,
        "vllm:kv_cache_usage_perc": 0.25,
    }
    for name, value in gauges.items():
        Gauge(name, name, LABELS, registry=reg).labels("m", "0").set(value)
    handover = Histogram(
        "vllm:kvpush_peer_handover_seconds", "h", (*LABELS, "peer"), registry=reg
    )
    handover.labels("m", "0", "decode0").observe(0.004)
    in_flight = Gauge(
        "vllm:kvpush_peer_bytes_in_flight", "b", (*LABELS, "peer"), registry=reg
    )
    in_flight.labels("m", "0", "decode0").set(4096)
    buckets = [i / 100 for i in range(1, 200)]
    ttft = Histogram(
        "vllm:time_to_first_token_seconds", "t", LABELS, buckets=buckets, registry=reg
    )
    ttft.labels("m", "0").observe(0.1)
    return reg


class MetricsServer:
    """``GET /metrics`` through prometheus_client's WSGI app (the same
    ``name[]`` handling as the ASGI app vLLM mounts); keeps what it sent."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._app = make_wsgi_app(registry)
        self.bodies: list[str] = []
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        environ = {
            "QUERY_STRING": request.query_string,
            "REQUEST_METHOD": "GET",
            "PATH_INFO": "/metrics",
        }

        def start_response(status: str, headers: Iterable[Any]) -> None:
            del status, headers

        body = b"".join(self._app(environ, start_response)).decode()
        self.bodies.append(body)
        return web.Response(text=body)


async def test_the_scraper_reads_only_the_samples_it_needs() -> None:
    registry = vllm_registry()
    server = MetricsServer(registry)
    url = await server.start()
    board = SignalBoard(max_age_s=10.0)
    scraper = SignalScraper([], board, interval_s=1.0, timeout_s=5.0)
    backend = Backend(role="prefill", url=url, engine_id="prefill0")
    try:
        async with aiohttp.ClientSession() as session:
            assert await scraper.read_once(session, backend)
    finally:
        await server.close()

    (body,) = server.bodies
    assert "vllm:num_requests_running" in body
    assert "time_to_first_token" not in body, "the whole exposition was asked for"
    whole = generate_latest(registry).decode()
    assert parse_scrape(body) == parse_scrape(whole), "a signal was filtered out"
    now = time.monotonic()
    signals = board.signals("prefill0", now)
    assert signals is not None
    assert (signals.num_running, signals.num_waiting) == (3, 1)
    assert signals.kv_usage == 0.25
    pair = board.pair("prefill0", "decode0", now)
    assert pair is not None and pair.bytes_in_flight == 4096
