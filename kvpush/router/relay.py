"""The client side: relaying a backend's answer, or an error, to the client.

Once :func:`relay` prepares the client response (the status line is sent),
``ctx.client_response`` is set and the request can no longer be retried. A
write that finds the client gone raises :class:`ClientGone`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from kvpush.router.context import ClientGone, FlowContext
from kvpush.router.errors import JSON_CONTENT_TYPE, RouterError
from kvpush.router.first_token import DONE_EVENT
from kvpush.router.legs import is_event_stream, note_output, read_chunk, read_rest
from kvpush.topology import Backend

logger = logging.getLogger(__name__)


async def relay(
    ctx: FlowContext,
    leg: str,
    backend: Backend,
    response: aiohttp.ClientResponse,
    first: bytes,
    rewrite: Callable[[bytes], bytes] | None = None,
) -> web.StreamResponse:
    """Send a backend's successful answer to the client, streaming SSE as it
    comes (each piece through ``rewrite`` when given)."""
    content_type = response.headers.get("Content-Type", JSON_CONTENT_TYPE)
    if is_event_stream(response):
        out = web.StreamResponse(
            status=response.status,
            headers={"Content-Type": content_type, "Cache-Control": "no-cache"},
        )
        await start_client(ctx, out)
        chunk = first
        while chunk:
            note_output(ctx, chunk, True)
            await write_client(ctx, out, chunk if rewrite is None else rewrite(chunk))
            chunk = await read_chunk(leg, backend, response)
        response.release()  # at EOF: the connection goes back to the pool
        await finish_client(ctx, out)
        return out
    body = first + await read_rest(leg, backend, response)
    out = web.Response(
        status=response.status, body=body, headers={"Content-Type": content_type}
    )
    await start_client(ctx, out)
    await finish_client(ctx, out)
    return out


async def reply_error(ctx: FlowContext, err: RouterError) -> web.StreamResponse:
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


async def start_client(ctx: FlowContext, out: web.StreamResponse) -> None:
    out.headers.update(ctx.response_headers)  # kvpush: binding and decode
    try:
        await out.prepare(ctx.request)
    except ConnectionResetError as e:
        raise ClientGone from e
    ctx.client_response = out  # the status line is out: no retry from here on


async def write_client(ctx: FlowContext, out: web.StreamResponse, chunk: bytes) -> None:
    """Write ``chunk`` to the client; once the stream's final event
    (``data: [DONE]``) is out, the client has its whole answer."""
    try:
        await out.write(chunk)
    except ConnectionResetError as e:
        raise ClientGone from e
    ctx.sent_tail = (ctx.sent_tail + chunk)[-len(DONE_EVENT) :]
    if ctx.sent_tail == DONE_EVENT:
        ctx.is_client_done = True


async def finish_client(ctx: FlowContext, out: web.StreamResponse) -> None:
    """End the client's answer. A client that read the final event may
    already have closed: its answer is complete, and that is no error."""
    had_final_event = ctx.is_client_done
    ctx.is_client_done = True
    try:
        await out.write_eof()
    except ConnectionResetError as e:
        if not had_final_event:
            raise ClientGone from e
