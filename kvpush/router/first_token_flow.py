"""The first token from prefill, on the wire (the rules: ``first_token.py``).

kvpush's early and late flows (``dispatch.py``) call :func:`stream_first`
once prefill answered: it opens the client's stream with ``t1``; then
:func:`follow` relays decode's stream (early binding: without its copy of
``t1``; late binding: decode's leg is already a continuation from ``t1``)
and, when decode diverges or fails, :func:`_continue` finishes the output
from a decode with a continuation request. From the first byte the client got, the
request is no longer retried: whatever fails after is continued or ends the
stream with an error event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable

import aiohttp
from aiohttp import web

from kvpush.router.context import FlowContext
from kvpush.router.errors import RouterError
from kvpush.router.first_token import (
    DONE_EVENT,
    Continuation,
    DecodeEcho,
    Diverged,
    FirstToken,
    Outcome,
    Progress,
    continuation_body,
    ends_at_first,
    opening_events,
)
from kvpush.router.legs import note_handover, open_first, read_chunk
from kvpush.router.relay import finish_client, start_client, write_client
from kvpush.router.requests import ENDPOINT_PATHS
from kvpush.topology import Backend

logger = logging.getLogger(__name__)

Opened = Awaitable[tuple[aiohttp.ClientResponse, bytes]]


async def stream_first(ctx: FlowContext, first: FirstToken) -> web.StreamResponse:
    """Open the client's stream with prefill's ``t1`` (TTFT is now); a request
    that ends at ``t1`` is answered whole."""
    out = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
    )
    await start_client(ctx, out)
    ctx.is_ttft_recorded = True
    ctx.metrics.observe_ttft(ctx.parsed.endpoint, time.monotonic() - ctx.started_at)
    await write_client(ctx, out, opening_events(first, ctx.parsed))
    if ends_at_first(first, ctx.parsed):
        ctx.metrics.first_token(Outcome.ENDED.value)
        await finish_client(ctx, out)
    return out


async def follow(
    ctx: FlowContext,
    out: web.StreamResponse,
    first: FirstToken,
    decode: Backend,
    opened: Opened,
    *,
    from_first: bool = False,
) -> None:
    """Relay decode's stream after ``t1`` (``opened``: its leg being opened);
    continue elsewhere when it diverges or fails. Decode's leg is the
    client's request (its copy of ``t1`` is dropped) or, ``from_first``, a
    continuation from ``t1`` (:func:`continuation_body`)."""
    echo: DecodeEcho | Continuation
    if from_first:
        echo = Continuation(ctx.parsed, first, Progress())
    else:
        echo = DecodeEcho(ctx.parsed, first)
    response: aiohttp.ClientResponse | None = None
    try:
        response, data = await opened
        while data:
            piece = echo.feed(data)
            if piece:
                _note_second_token(ctx)
                await write_client(ctx, out, piece)
            data = await read_chunk("decode", decode, response)
        response.release()
        if not echo.progress.is_done:
            raise Diverged("decode's stream ended before [DONE]")
    except (Diverged, RouterError) as e:
        if response is not None:
            response.close()  # vLLM aborts the request on close
        logger.warning(
            "request %s: decode %s after the first token from prefill (%s); "
            "continuing from it",
            ctx.request_id,
            "failed" if isinstance(e, RouterError) else "diverged",
            e,
        )
        ctx.metrics.first_token(Outcome.CONTINUED.value)
        await _continue(ctx, out, first, echo.progress, decode, e)
        return
    ctx.metrics.first_token(Outcome.PREFILL.value)
    await finish_client(ctx, out)


async def _continue(
    ctx: FlowContext,
    out: web.StreamResponse,
    first: FirstToken,
    progress: Progress,
    decode: Backend,
    cause: Exception,
) -> None:
    """Finish the client's output from a decode: the one that diverged (its
    prefix cache holds the prompt) or, when it failed, another if any."""
    if progress.is_finished:
        if not progress.is_done:
            await write_client(ctx, out, DONE_EVENT)
        await finish_client(ctx, out)
        return
    candidates = ctx.config.topology.decodes
    if isinstance(cause, RouterError):
        others = tuple(b for b in candidates if b.engine_id != decode.engine_id)
        candidates = others or candidates
    backend = ctx.pick("decode", candidates)
    body = continuation_body(ctx.parsed, first, progress)
    response, data = await open_first(
        ctx, "decode", backend, body, path=ENDPOINT_PATHS["completions"]
    )
    if response.content_type != "text/event-stream":
        raise RouterError.from_backend(response.status, data, "decode", backend)
    rewrite = Continuation(ctx.parsed, first, progress)
    while data:
        await write_client(ctx, out, rewrite.feed(data))
        data = await read_chunk("decode", backend, response)
    response.release()
    await finish_client(ctx, out)


def _note_second_token(ctx: FlowContext) -> None:
    """Decode's first output relayed after ``t1``: the handover's end."""
    if ctx.first_byte_at is None:
        ctx.first_byte_at = time.monotonic()
        note_handover(ctx)
