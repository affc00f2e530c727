"""The router's aiohttp application and its blocking entry point.

``run_router`` (called by the CLI) serves until SIGINT/SIGTERM;
``start_router`` (used by ``run_router`` and by tests) starts the server on
the running loop and returns a handle to close it. The app owns one
``aiohttp.ClientSession`` and one :class:`HealthMonitor`: the session is
created at start-up, then the health checks start; at clean-up the checks
stop before the session closes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.router import connector_stats
from kvpush.router.admin import add_admin_routes
from kvpush.router.config import RouterConfig
from kvpush.router.context import FlowContext
from kvpush.router.dispatch import serve
from kvpush.router.errors import RouterError, bad_request
from kvpush.router.metrics import RouterMetrics
from kvpush.router.monitor import HealthMonitor, probe
from kvpush.router.requests import Endpoint, parse_request
from kvpush.router.routing import Routing
from kvpush.router.selection import RoundRobinSelector, Selector
from kvpush.topology import Backend

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
N_MODES = ("colocated", "kvpush")  # modes that serve n > 1 (parallel sampling)
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass
class RouterState:
    """What every handler shares; ``session`` exists between start-up and clean-up."""

    config: RouterConfig
    selector: Selector
    metrics: RouterMetrics
    health: HealthMonitor
    connector_events: connector_stats.ConnectorEvents
    routing: Routing | None = None  # kvpush mode only
    session: aiohttp.ClientSession | None = None

    def client(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the router's HTTP client is not started")
        return self.session


STATE = web.AppKey("kvpush_router_state", RouterState)
REQUEST_ID = web.RequestKey("kvpush_request_id", str)  # needs aiohttp >= 3.14
CLIENT_REQUEST_ID = web.RequestKey("kvpush_client_request_id", str)


def build_app(
    config: RouterConfig, selector: Selector | None = None
) -> web.Application:
    """The router app for ``config``; ``selector`` defaults to round robin."""
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[_request_id_middleware, _error_middleware],
    )
    metrics = RouterMetrics(config.mode)
    events = connector_stats.ConnectorEvents()
    metrics.register(events)
    health = HealthMonitor(config, metrics)
    routing = None
    if config.mode == "kvpush":
        routing = Routing(config, health.board, metrics)
        health.down_listeners.append(routing.instance_down)
    app[STATE] = RouterState(
        config=config,
        selector=selector or RoundRobinSelector(),
        metrics=metrics,
        health=health,
        connector_events=events,
        routing=routing,
    )
    app.cleanup_ctx.append(_client_session)
    app.cleanup_ctx.append(_health_checks)  # cleaned up first: before the session
    app.cleanup_ctx.append(_signal_reads)  # cleaned up before the health checks
    app.on_response_prepare.append(_echo_request_id)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    add_admin_routes(app, lambda request: request.app[STATE].health.board)
    return app


# How long the router keeps an idle connection to an instance for reuse:
# below vLLM's own keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so a leg is
# never sent on a connection the instance is closing (aiohttp's default, 15 s,
# made a leg fail now and then with "Server disconnected" after an idle spell).
IDLE_CONNECTION_S = 4.0


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=state.config.connect_timeout_s,
        sock_connect=state.config.connect_timeout_s,
    )
    connector = aiohttp.TCPConnector(  # deadlines bound use, not a pool cap
        limit=0, keepalive_timeout=IDLE_CONNECTION_S
    )
    state.session = aiohttp.ClientSession(timeout=timeout, connector=connector)
    try:
        yield
    finally:
        await state.session.close()
        state.session = None


async def _health_checks(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.health.start(state.client())
    try:
        yield
    finally:
        await state.health.close()


async def _signal_reads(app: web.Application) -> AsyncIterator[None]:
    routing = app[STATE].routing
    if routing is None:
        yield
        return
    routing.start(app[STATE].client())
    try:
        yield
    finally:
        await routing.close()


# -- middleware ------------------------------------------------------------


@web.middleware
async def _request_id_middleware(
    request: web.Request, handler: Any
) -> web.StreamResponse:
    """Give every request a unique id for its legs: a fresh uuid4, prefixed by
    the client's X-Request-Id when it sent one. vLLM pairs push legs by this
    id, so two client requests reusing one X-Request-Id must not share it."""
    given = request.headers.get(REQUEST_ID_HEADER)
    request[REQUEST_ID] = uuid.uuid4().hex
    if given is not None:
        if not _REQUEST_ID_RE.fullmatch(given):
            return bad_request(
                "X-Request-Id must be 1-128 characters of A-Z a-z 0-9 . _ : -"
            ).to_response()
        request[CLIENT_REQUEST_ID] = given
        request[REQUEST_ID] = f"{given}.{request[REQUEST_ID]}"
    response: web.StreamResponse = await handler(request)
    return response


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answer 404/405/413 and unexpected failures in the OpenAI error shape."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except RouterError as err:
        return err.to_response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{exc.reason}: {request.method} {request.path}"
        err_type = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return RouterError.openai(
            exc.status, message, err_type, str(exc.status)
        ).to_response()
    except Exception:
        logger.exception("request %s: unexpected router error", request.get(REQUEST_ID))
        return RouterError.openai(
            500, "internal router error", "internal_error", "internal_error"
        ).to_response()


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Answer with the client's own X-Request-Id, else the router's."""
    request_id = request.get(CLIENT_REQUEST_ID) or request.get(REQUEST_ID)
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id


# -- handlers --------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """Parse a generation request at the edge, then hand it to ``serve``."""
    state, started = request.app[STATE], time.monotonic()
    try:
        raw = await request.read()
        parsed = parse_request(raw, endpoint, allow_n=state.config.mode in N_MODES)
    except (RouterError, web.HTTPRequestEntityTooLarge) as exc:
        err = exc if isinstance(exc, RouterError) else _too_large(state.config)
        state.metrics.rejected(endpoint, str(err.status), err.cause)
        return err.to_response()
    ctx = FlowContext(
        request=request,
        parsed=parsed,
        request_id=request[REQUEST_ID],
        session=state.client(),
        config=state.config,
        selector=state.selector,
        metrics=state.metrics,
        health=state.health,
        started_at=started,
        routing=state.routing,
    )
    return await serve(ctx)


def _too_large(config: RouterConfig) -> RouterError:
    return RouterError.openai(
        413,
        f"request body exceeds max_body_bytes={config.max_body_bytes}",
        "invalid_request_error",
        "body_too_large",
    )


async def _models(request: web.Request) -> web.Response:
    """Proxy ``GET /v1/models`` to the first healthy decode (or colocated)
    backend, else the first one."""
    state = request.app[STATE]
    topology = state.config.topology
    candidates = topology.decodes or topology.colocated
    healthy = [b for b in candidates if state.health.board.is_healthy(b.engine_id)]
    backend = (healthy or candidates)[0]
    url = backend.url.rstrip("/") + "/v1/models"
    headers = {REQUEST_ID_HEADER: request[REQUEST_ID]}
    try:
        async with asyncio.timeout(state.config.request_timeout_s):
            async with state.client().get(url, headers=headers) as upstream:
                body = await upstream.read()
                content_type = upstream.headers.get("Content-Type", "application/json")
    except TimeoutError:
        raise RouterError.openai(
            504,
            f"timed out asking {backend.engine_id!r} for models",
            "timeout_error",
            "timeout",
        ) from None
    except aiohttp.ClientError as e:
        raise RouterError.openai(
            502,
            f"cannot reach backend {backend.engine_id!r} at {backend.url}: {e}",
            "upstream_error",
            "models_unreachable",
        ) from e
    return web.Response(
        status=upstream.status, body=body, headers={"Content-Type": content_type}
    )


async def _health(request: web.Request) -> web.Response:
    """Liveness: 200 while this process serves, whatever its backends do
    (an orchestrator's liveness probe must not restart a router that routes
    around a dead instance). Readiness is ``/ready``."""
    return web.json_response({"status": "ok", "mode": request.app[STATE].config.mode})


async def _ready(request: web.Request) -> web.Response:
    """Readiness: 200 when every role the mode needs has a backend whose
    ``/health`` answers 200 in time and that the router routes to, else 503
    (``degraded`` when some backend is down but every role is served).
    Each backend's report says whether it answered and is routed now."""
    state = request.app[STATE]
    backends = state.config.topology.backends
    reports = await asyncio.gather(*(_report(state, b) for b in backends))
    served = {r["role"] for r in reports if r["healthy"] and r["routed"]}
    is_ready = {b.role for b in backends} <= served
    is_whole = all(r["healthy"] for r in reports)
    body = {
        "status": "ok" if is_whole else "degraded" if is_ready else "unavailable",
        "mode": state.config.mode,
        "backends": reports,
    }
    return web.json_response(body, status=200 if is_ready else 503)


async def _report(state: RouterState, backend: Backend) -> dict[str, Any]:
    result = await probe(state.client(), backend, state.config.health_timeout_s)
    state.health.record(backend, result)
    return {
        "engine_id": backend.engine_id,
        "role": backend.role,
        "url": backend.url,
        "healthy": result.is_ok,
        "routed": state.health.board.is_routable(backend.engine_id),
        "status": result.status,
        "error": result.error,
    }


async def _metrics(request: web.Request) -> web.Response:
    """The router's metrics; in kvpush mode also the connector's events,
    scraped from the instances' ``/metrics`` first (bounded)."""
    state = request.app[STATE]
    if state.config.mode == "kvpush":
        topology = state.config.topology
        instances = [*topology.prefills, *topology.decodes]
        totals = await connector_stats.scrape(state.client(), instances)
        state.connector_events.totals = totals
    text = state.metrics.render()
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


# -- running ---------------------------------------------------------------


@dataclass
class RunningRouter:
    """A router serving on the current loop; ``close()`` stops it."""

    runner: web.AppRunner
    url: str

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_router(
    config: RouterConfig, selector: Selector | None = None
) -> RunningRouter:
    """Start serving ``config`` on the running loop (port 0: any free port).

    Handlers are cancelled when their client disconnects, which is how the
    flows learn to abort their upstream legs while they wait.
    """
    runner = web.AppRunner(
        build_app(config, selector),
        handler_cancellation=True,
        shutdown_timeout=config.shutdown_timeout_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else config.port
    return RunningRouter(runner=runner, url=f"http://{config.host}:{port}")


def run_router(config: RouterConfig, selector: Selector | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then close cleanly. Blocks."""
    asyncio.run(_serve_until_signalled(config, selector))


async def _serve_until_signalled(
    config: RouterConfig, selector: Selector | None
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    router = await start_router(config, selector)
    logger.info("router (%s) serving on %s", config.mode, router.url)
    try:
        await stop.wait()
    finally:
        logger.info("router shutting down")
        await router.close()
