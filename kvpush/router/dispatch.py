"""The request flows: how one client request becomes one or two upstream legs.

``app.py`` parses a generation request, builds a :class:`FlowContext` and
calls :func:`serve`, which runs the mode's flow from :data:`FLOWS` under the
request deadline, turns failures into OpenAI-shaped replies, records metrics
and, whatever happened, aborts every leg still open (closing its connection is
how vLLM learns to abort the request). Adding a mode is one flow function and
one :data:`FLOWS` entry.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.router.config import RouterConfig
from kvpush.router.errors import (
    JSON_CONTENT_TYPE,
    RouterError,
    bad_gateway,
    unreachable,
    upstream_timeout,
)
from kvpush.router.metrics import RouterMetrics
from kvpush.router.requests import ParsedRequest, PushDecodeParams, returned_kv_params
from kvpush.router.selection import Selector
from kvpush.topology import Backend
from kvpush.transfer.messages import DecodeLeg, PrefillLeg

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 2.0  # how long aborting waits for cancelled leg tasks to unwind
SSE_CONTENT_TYPE = "text/event-stream"
FORWARDED_HEADERS = ("Authorization",)


class ClientGone(Exception):
    """The client closed its connection while the router was writing to it."""


class Legs:
    """Owns one request's upstream responses and leg tasks.

    Flows register what they open; :func:`serve` calls :meth:`abort` when the
    request ends, which cancels unfinished tasks and closes every response
    not yet fully read (a fully read one went back to the pool already).
    """

    def __init__(self) -> None:
        self._responses: list[aiohttp.ClientResponse] = []
        self._tasks: list[asyncio.Task[Any]] = []

    def track(self, response: aiohttp.ClientResponse) -> None:
        self._responses.append(response)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def abort(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=ABORT_WAIT_S)
        for task in self._tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a failure was already reported
        for response in self._responses:
            response.close()


@dataclass
class FlowContext:
    """One client request in flight: its inputs and what it has opened."""

    request: web.Request
    parsed: ParsedRequest
    request_id: str
    session: aiohttp.ClientSession
    config: RouterConfig
    selector: Selector
    metrics: RouterMetrics
    started_at: float = field(default_factory=time.monotonic)
    legs: Legs = field(default_factory=Legs)
    client_response: web.StreamResponse | None = None
    is_client_done: bool = False
    is_ttft_recorded: bool = False


Flow = Callable[[FlowContext], Awaitable[web.StreamResponse]]


async def serve(ctx: FlowContext) -> web.StreamResponse:
    """Run the mode's flow for one request; called by the app's handlers."""
    ctx.metrics.request_started()
    status = "500"
    try:
        response, status = await _run_flow(ctx, FLOWS[ctx.config.mode])
        return response
    except asyncio.CancelledError:
        status = "499"
        ctx.metrics.error("client_disconnected")
        logger.info("request %s: client disconnected", ctx.request_id)
        raise
    finally:
        await ctx.legs.abort()
        elapsed = time.monotonic() - ctx.started_at
        ctx.metrics.request_finished(ctx.parsed.endpoint, status, elapsed)


async def _run_flow(ctx: FlowContext, flow: Flow) -> tuple[web.StreamResponse, str]:
    try:
        async with asyncio.timeout(ctx.config.request_timeout_s):
            response = await flow(ctx)
        return response, str(response.status)
    except TimeoutError:
        err = upstream_timeout(
            f"no complete answer within request_timeout_s="
            f"{ctx.config.request_timeout_s} (request {ctx.request_id})"
        )
    except RouterError as e:
        err = e
    except ClientGone:
        ctx.metrics.error("client_disconnected")
        logger.info("request %s: client went away mid-response", ctx.request_id)
        return ctx.client_response or web.Response(status=499), "499"
    ctx.metrics.error(err.cause)
    logger.warning("request %s failed: %s", ctx.request_id, err)
    return await _reply_error(ctx, err), str(err.status)


async def _reply_error(ctx: FlowContext, err: RouterError) -> web.StreamResponse:
    """The error as a response, or as a final SSE event if a stream has begun."""
    out = ctx.client_response
    if out is None:
        return err.to_response()
    if not ctx.is_client_done:
        ctx.is_client_done = True
        try:
            await out.write(err.to_sse_event())
            await out.write_eof()
        except ConnectionResetError:
            logger.info("request %s: client gone before the error", ctx.request_id)
    return out


# -- the flows -------------------------------------------------------------


async def colocated_flow(ctx: FlowContext) -> web.StreamResponse:
    """Forward the body unchanged to one colocated backend; relay its answer."""
    backend = ctx.selector.pick_decode(ctx.config.topology.colocated, ctx.parsed)
    response, first = await _open_first(ctx, "colocated", backend, ctx.parsed.raw)
    return await _relay(ctx, "colocated", backend, response, first)


async def pull_flow(ctx: FlowContext) -> web.StreamResponse:
    """vLLM pull: prefill first, then decode with the KV params prefill returned."""
    prefill = ctx.selector.pick_prefill(ctx.config.topology.prefills, ctx.parsed)
    prefill_answer = await _run_prefill(ctx, prefill)
    kv_params = returned_kv_params(prefill_answer, prefill)
    decode = ctx.selector.pick_decode(ctx.config.topology.decodes, ctx.parsed)
    body = ctx.parsed.decode_body(kv_params)
    response, first = await _open_first(ctx, "decode", decode, body)
    return await _relay(ctx, "decode", decode, response, first)


async def push_flow(ctx: FlowContext) -> web.StreamResponse:
    """vLLM push: both legs at once, paired by vLLM through the shared
    X-Request-Id; decode is told the prefill's engine id and side channel."""

    def params(prefill: Backend, decode: Backend) -> tuple[Any, Any]:
        return None, PushDecodeParams.for_prefill(prefill, ctx.request_id)

    return await _concurrent_flow(ctx, params)


async def kvpush_flow(ctx: FlowContext) -> web.StreamResponse:
    """kvpush: both legs at once, paired exactly by a fresh transfer id; each
    leg names the peer it needs (prefill: the decode engine it pushes to;
    decode: the prefill engine and side channel it registers with)."""
    transfer_id = uuid.uuid4().hex
    logger.debug("request %s: transfer %s", ctx.request_id, transfer_id)

    def params(prefill: Backend, decode: Backend) -> tuple[Any, Any]:
        return (
            PrefillLeg(transfer_id=transfer_id, decode_engine_id=decode.engine_id),
            DecodeLeg(
                transfer_id=transfer_id,
                prefill_engine_id=prefill.engine_id,
                prefill_host=prefill.side_channel_host,
                prefill_port=prefill.side_channel_port,
            ),
        )

    return await _concurrent_flow(ctx, params)


async def _concurrent_flow(
    ctx: FlowContext, make_params: Callable[[Backend, Backend], tuple[Any, Any]]
) -> web.StreamResponse:
    """Both legs at once; the client gets decode's answer.

    ``make_params(prefill, decode)`` gives the two legs' ``kv_transfer_params``
    (None for prefill means vLLM's ``do_remote_decode``). Whichever leg fails
    before decode produced output decides the reply; the other is aborted by
    :func:`serve`. Prefill's answer is read and dropped.
    """
    topology, parsed = ctx.config.topology, ctx.parsed
    prefill = ctx.selector.pick_prefill(topology.prefills, parsed)
    decode = ctx.selector.pick_decode(topology.decodes, parsed)
    prefill_params, decode_params = make_params(prefill, decode)
    prefill_task = ctx.legs.spawn(
        _run_prefill(ctx, prefill, prefill_params), "prefill-leg"
    )
    decode_task = ctx.legs.spawn(
        _open_first(ctx, "decode", decode, parsed.decode_body(decode_params)),
        "decode-leg",
    )
    response, first = await _await_decode_start(prefill_task, decode_task)
    out = await _relay(ctx, "decode", decode, response, first)
    await _settle_prefill(ctx, prefill_task)
    return out


FLOWS: dict[str, Flow] = {
    "colocated": colocated_flow,
    "vllm-pull": pull_flow,
    "vllm-push": push_flow,
    "kvpush": kvpush_flow,
}


async def _await_decode_start(
    prefill_task: asyncio.Task[bytes],
    decode_task: asyncio.Task[tuple[aiohttp.ClientResponse, bytes]],
) -> tuple[aiohttp.ClientResponse, bytes]:
    """Wait (under serve's deadline) for decode's first bytes or a leg failure."""
    waiting: set[asyncio.Task[Any]] = {prefill_task, decode_task}
    while True:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if decode_task.done():
            decode_error = decode_task.exception()
            if decode_error is None:
                return decode_task.result()
            prefill_done = prefill_task.done() and not prefill_task.cancelled()
            prefill_error = prefill_task.exception() if prefill_done else None
            raise prefill_error or decode_error  # prefill's failure is the cause
        prefill_error = prefill_task.exception()
        if prefill_error is not None:
            raise prefill_error
        waiting = {decode_task}


async def _settle_prefill(ctx: FlowContext, task: asyncio.Task[bytes]) -> None:
    """After decode answered: give prefill a moment to finish, count a failure."""
    done, _ = await asyncio.wait({task}, timeout=ctx.config.connect_timeout_s)
    if not done:
        ctx.metrics.error("prefill_unfinished")
        logger.warning(
            "request %s: prefill leg still open after decode", ctx.request_id
        )
        return
    err = task.exception()
    if err is not None:
        cause = err.cause if isinstance(err, RouterError) else "prefill_failed"
        ctx.metrics.error(cause)
        logger.warning("request %s: prefill leg failed late: %s", ctx.request_id, err)


# -- legs ------------------------------------------------------------------


async def _run_prefill(
    ctx: FlowContext, backend: Backend, kv_transfer_params: Any = None
) -> bytes:
    """Send the prefill leg and return its (successful) answer's body."""
    started, outcome = time.monotonic(), "aborted"
    try:
        body = ctx.parsed.prefill_body(kv_transfer_params)
        response = await _open(ctx, "prefill", backend, body)
        body = await _read_rest("prefill", backend, response)
        if response.status >= 400:
            outcome = "error"
            raise RouterError.from_backend(response.status, body, "prefill", backend)
        outcome = "ok"
        return body
    except RouterError:
        outcome = "error"
        raise
    finally:
        ctx.metrics.observe_prefill(time.monotonic() - started, outcome)


async def _open(
    ctx: FlowContext, leg: str, backend: Backend, body: bytes
) -> aiohttp.ClientResponse:
    """POST one leg to ``backend`` (same path as the client's) until headers."""
    url = backend.url.rstrip("/") + ctx.parsed.path
    headers = {"X-Request-Id": ctx.request_id, "Content-Type": JSON_CONTENT_TYPE}
    for name in FORWARDED_HEADERS:
        if name in ctx.request.headers:
            headers[name] = ctx.request.headers[name]
    try:
        response = await ctx.session.post(url, data=body, headers=headers)
    except aiohttp.ClientError as e:
        raise _leg_failure(leg, backend, e) from e
    ctx.legs.track(response)
    return response


async def _open_first(
    ctx: FlowContext, leg: str, backend: Backend, body: bytes
) -> tuple[aiohttp.ClientResponse, bytes]:
    """Open a leg and read its first body bytes; an error status raises."""
    response = await _open(ctx, leg, backend, body)
    if response.status >= 400:
        error_body = await _read_rest(leg, backend, response)
        raise RouterError.from_backend(response.status, error_body, leg, backend)
    first = await _read_chunk(leg, backend, response)
    _note_output(ctx, first, _is_event_stream(response))
    return response, first


async def _read_chunk(
    leg: str, backend: Backend, response: aiohttp.ClientResponse
) -> bytes:
    try:
        return await response.content.readany()
    except aiohttp.ClientError as e:
        raise _leg_failure(leg, backend, e) from e


async def _read_rest(
    leg: str, backend: Backend, response: aiohttp.ClientResponse
) -> bytes:
    """Read the rest of a leg's body, returning its connection to the pool."""
    try:
        body = await response.content.read()
    except aiohttp.ClientError as e:
        raise _leg_failure(leg, backend, e) from e
    response.release()
    return body


def _leg_failure(leg: str, backend: Backend, e: aiohttp.ClientError) -> RouterError:
    if isinstance(e, aiohttp.ServerTimeoutError):
        return upstream_timeout(f"{leg} backend {backend.engine_id!r} at {backend.url}")
    if isinstance(e, aiohttp.ClientConnectorError):
        return unreachable(leg, backend, str(e.os_error or e))
    return bad_gateway(leg, backend, f"connection failed: {type(e).__name__} {e}")


# -- the client side -------------------------------------------------------


async def _relay(
    ctx: FlowContext,
    leg: str,
    backend: Backend,
    response: aiohttp.ClientResponse,
    first: bytes,
) -> web.StreamResponse:
    """Send a backend's successful answer to the client, streaming SSE as it comes."""
    content_type = response.headers.get("Content-Type", JSON_CONTENT_TYPE)
    if _is_event_stream(response):
        out = web.StreamResponse(
            status=response.status,
            headers={"Content-Type": content_type, "Cache-Control": "no-cache"},
        )
        await _start_client(ctx, out)
        chunk = first
        while chunk:
            _note_output(ctx, chunk, True)
            await _write_client(out, chunk)
            chunk = await _read_chunk(leg, backend, response)
        response.release()  # at EOF: the connection goes back to the pool
        await _finish_client(ctx, out)
        return out
    body = first + await _read_rest(leg, backend, response)
    out = web.Response(
        status=response.status, body=body, headers={"Content-Type": content_type}
    )
    await _start_client(ctx, out)
    await _finish_client(ctx, out)
    return out


def _note_output(ctx: FlowContext, chunk: bytes, is_sse: bool) -> None:
    """Record TTFT at decode's first body byte (SSE: first ``data:`` event)."""
    if ctx.is_ttft_recorded or not chunk or (is_sse and b"data:" not in chunk):
        return
    ctx.is_ttft_recorded = True
    ctx.metrics.observe_ttft(ctx.parsed.endpoint, time.monotonic() - ctx.started_at)


def _is_event_stream(response: aiohttp.ClientResponse) -> bool:
    return response.content_type == SSE_CONTENT_TYPE


async def _start_client(ctx: FlowContext, out: web.StreamResponse) -> None:
    try:
        await out.prepare(ctx.request)
    except ConnectionResetError as e:
        raise ClientGone from e
    ctx.client_response = out


async def _write_client(out: web.StreamResponse, chunk: bytes) -> None:
    try:
        await out.write(chunk)
    except ConnectionResetError as e:
        raise ClientGone from e


async def _finish_client(ctx: FlowContext, out: web.StreamResponse) -> None:
    try:
        await out.write_eof()
    except ConnectionResetError as e:
        raise ClientGone from e
    ctx.is_client_done = True
