"""Upstream leg I/O: sending a leg to a backend and reading its answer.

The flows in ``dispatch.py`` call these; every response opened is tracked by
the attempt's :class:`~kvpush.router.context.Legs`, and every aiohttp failure
becomes a :class:`RouterError` naming the leg and backend. A leg that cannot
connect (refused, unreachable, connect timeout, reset before any answer) also
marks its backend unhealthy at once, so routing avoids it before the next
health probe. Waits are bounded by the request deadline that ``dispatch``
sets around each request, and connects by ``connect_timeout_s``.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from kvpush.router.context import FlowContext
from kvpush.router.errors import (
    JSON_CONTENT_TYPE,
    RouterError,
    bad_gateway,
    unreachable,
    upstream_timeout,
)
from kvpush.topology import Backend

FORWARDED_HEADERS = ("Authorization",)
# vLLM's per-request choice of data-parallel rank (its internal load balancer)
DP_RANK_HEADER = "X-data-parallel-rank"
SSE_CONTENT_TYPE = "text/event-stream"


async def run_prefill(
    ctx: FlowContext, backend: Backend, kv_transfer_params: Any = None
) -> bytes:
    """Send the prefill leg and return its (successful) answer's body."""
    started, outcome = time.monotonic(), "aborted"
    try:
        body = ctx.parsed.prefill_body(kv_transfer_params, ctx.leg_fields)
        response = await open_leg(ctx, "prefill", backend, body)
        body = await read_rest("prefill", backend, response)
        if response.status >= 400:
            outcome = "error"
            raise RouterError.from_backend(response.status, body, "prefill", backend)
        outcome = "ok"
        ctx.prefill_answered_at = time.monotonic()
        note_handover(ctx)
        return body
    except RouterError:
        outcome = "error"
        raise
    finally:
        ctx.metrics.observe_prefill(time.monotonic() - started, outcome)


async def open_leg(
    ctx: FlowContext, leg: str, backend: Backend, body: bytes, path: str | None = None
) -> aiohttp.ClientResponse:
    """POST one leg to ``backend`` (by default on the client's path) until
    headers."""
    url = backend.url.rstrip("/") + (path or ctx.parsed.path)
    headers = {"X-Request-Id": ctx.leg_request_id, "Content-Type": JSON_CONTENT_TYPE}
    for name in FORWARDED_HEADERS:
        if name in ctx.request.headers:
            headers[name] = ctx.request.headers[name]
    if backend.dp_rank is not None:  # one DP rank of an instance: pin it
        headers[DP_RANK_HEADER] = str(backend.dp_rank)
    try:
        response = await ctx.session.post(url, data=body, headers=headers)
    except aiohttp.ClientError as e:
        if is_connect_failure(e):
            ctx.health.mark_unreachable(backend, _describe(e))
        raise leg_failure(leg, backend, e, is_before_answer=True) from e
    ctx.legs.track(response)
    return response


async def open_first(
    ctx: FlowContext, leg: str, backend: Backend, body: bytes, path: str | None = None
) -> tuple[aiohttp.ClientResponse, bytes]:
    """Open a leg and read its first body bytes; an error status raises."""
    response = await open_leg(ctx, leg, backend, body, path)
    if response.status >= 400:
        error_body = await read_rest(leg, backend, response)
        raise RouterError.from_backend(response.status, error_body, leg, backend)
    first = await read_chunk(leg, backend, response)
    note_output(ctx, first, is_event_stream(response))
    return response, first


async def read_chunk(
    leg: str, backend: Backend, response: aiohttp.ClientResponse
) -> bytes:
    try:
        return await response.content.readany()
    except aiohttp.ClientError as e:
        raise leg_failure(leg, backend, e) from e


async def read_rest(
    leg: str, backend: Backend, response: aiohttp.ClientResponse
) -> bytes:
    """Read the rest of a leg's body, returning its connection to the pool."""
    try:
        body = await response.content.read()
    except aiohttp.ClientError as e:
        raise leg_failure(leg, backend, e) from e
    response.release()
    return body


def is_connect_failure(e: aiohttp.ClientError) -> bool:
    """Whether ``e``, raised before any answer, says the backend is not there:
    refused or unreachable, a connect timeout, a reset or a closed connection."""
    return isinstance(
        e,
        aiohttp.ClientConnectorError
        | aiohttp.ConnectionTimeoutError
        | aiohttp.ServerDisconnectedError
        | aiohttp.ClientOSError,
    )


def is_connection_lost(err: BaseException) -> bool:
    """Whether a leg's error says its connection broke (refused, reset,
    closed, or cut off mid-answer), as opposed to an answer the backend gave:
    what a dead instance looks like."""
    if isinstance(err, RouterError) and err.kind == "unreachable":
        return True
    cause = err.__cause__
    return isinstance(cause, aiohttp.ClientError) and (
        is_connect_failure(cause) or isinstance(cause, aiohttp.ClientPayloadError)
    )


def leg_failure(
    leg: str, backend: Backend, e: aiohttp.ClientError, is_before_answer: bool = False
) -> RouterError:
    """The error for a leg's aiohttp failure: a 504 timeout, a 502 unreachable
    (also a connection dropped before any answer) or another 502."""
    if isinstance(e, aiohttp.ServerTimeoutError):
        return upstream_timeout(
            f"{leg} backend {backend.engine_id!r} at {backend.url}", backend
        )
    if is_before_answer and is_connect_failure(e):
        return unreachable(leg, backend, _describe(e))
    return bad_gateway(leg, backend, f"connection failed: {type(e).__name__} {e}")


def note_output(ctx: FlowContext, chunk: bytes, is_sse: bool) -> None:
    """Record TTFT at decode's first body byte (SSE: first ``data:`` event)."""
    if ctx.is_ttft_recorded or not chunk or (is_sse and b"data:" not in chunk):
        return
    ctx.is_ttft_recorded = True
    ctx.first_byte_at = time.monotonic()
    ctx.metrics.observe_ttft(ctx.parsed.endpoint, ctx.first_byte_at - ctx.started_at)
    note_handover(ctx)


def note_handover(ctx: FlowContext) -> None:
    """Once prefill's answer and decode's first byte are both in (whichever
    came second calls this): the router's view of the handover."""
    if ctx.prefill_answered_at is not None and ctx.first_byte_at is not None:
        ctx.metrics.observe_handover(ctx.first_byte_at - ctx.prefill_answered_at)


def is_event_stream(response: aiohttp.ClientResponse) -> bool:
    return response.content_type == SSE_CONTENT_TYPE


def _describe(e: aiohttp.ClientError) -> str:
    if isinstance(e, aiohttp.ClientConnectorError):
        return str(e.os_error or e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
