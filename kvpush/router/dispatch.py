"""The request flows: how one client request becomes one or two upstream legs.

``app.py`` parses a generation request, builds a :class:`FlowContext` and
calls :func:`serve`, which runs the mode's flow from :data:`FLOWS` under the
request deadline, turns failures into OpenAI-shaped replies, records metrics
and, whatever happened, aborts every leg still open (closing its connection is
how vLLM learns to abort the request). Adding a mode is one flow function and
one :data:`FLOWS` entry.

A request runs as one or more attempts (:func:`_run_attempts`): when an
attempt fails with a retryable upstream failure before anything reached the
client, its legs are aborted and the flow runs again, on other instances,
with fresh leg ids, up to ``max_attempts`` (``retry.py`` decides). All
attempts share the one request deadline.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvpush.router.config import FirstTokenFrom
from kvpush.router.context import ClientGone, FlowContext
from kvpush.router.errors import RouterError, upstream_timeout
from kvpush.router.first_token import (
    DecodeEcho,
    Outcome,
    Progress,
    asks_one_token,
    blocker,
    continuation_body,
    ends_at_first,
    leg_fields,
    read_answer,
)
from kvpush.router.first_token_flow import follow, stream_first
from kvpush.router.legs import is_connection_lost, open_first, run_prefill
from kvpush.router.planner import RoutePlan
from kvpush.router.relay import relay, reply_error
from kvpush.router.requests import (
    ENDPOINT_PATHS,
    PushDecodeParams,
    returned_kv_params,
)
from kvpush.router.selection import has_every_role
from kvpush.topology import Backend
from kvpush.transfer.messages import DecodeLeg, PrefillLeg, claim_digest

logger = logging.getLogger(__name__)


Flow = Callable[[FlowContext], Awaitable[web.StreamResponse]]


async def serve(ctx: FlowContext) -> web.StreamResponse:
    """Run the mode's flow for one request; called by the app's handlers."""
    ctx.metrics.request_started()
    status = "500"
    flow = asyncio.create_task(_run_flow(ctx, FLOWS[ctx.config.mode]))
    try:
        response, status = await _outcome(ctx, flow)
        return response
    except asyncio.CancelledError:
        status = "499"
        ctx.metrics.error("client_disconnected")
        ctx.metrics.failed("client_gone")
        logger.info("request %s: client disconnected", ctx.request_id)
        raise
    finally:
        elapsed = time.monotonic() - ctx.started_at
        ctx.metrics.request_finished(ctx.parsed.endpoint, status, elapsed)
        # A client that hangs up right after the last byte cancels this
        # handler; the legs must still be closed (vLLM frees on close).
        try:
            await asyncio.shield(ctx.legs.abort())
        finally:
            ctx.release()


async def _outcome(
    ctx: FlowContext, flow: asyncio.Task[tuple[web.StreamResponse, str]]
) -> tuple[web.StreamResponse, str]:
    """The response and status of the request's ``flow`` (a task of its
    own). A client that hangs up cancels this handler. While its answer is
    unfinished the flow is cancelled with it (the legs are aborted). Once
    the client has its whole answer (clients close as soon as they read
    ``[DONE]``, before the backend's stream has ended) the flow finishes: what
    it records after the last byte (the first token's outcome, the prefix
    index, the prefill leg's end) must not be lost, nor the request counted
    as one the client left."""
    try:
        return await asyncio.shield(flow)
    except asyncio.CancelledError:
        if not ctx.is_client_done:
            flow.cancel()
            await asyncio.wait({flow})
            raise
    handler = asyncio.current_task()
    if handler is not None:
        handler.uncancel()  # the cancel was the client's close, not an abort
    return await flow


async def _run_flow(ctx: FlowContext, flow: Flow) -> tuple[web.StreamResponse, str]:
    try:
        async with asyncio.timeout(ctx.config.request_timeout_s):
            response = await _run_attempts(ctx, flow)
        return response, str(response.status)
    except TimeoutError:
        err = upstream_timeout(
            f"no complete answer within request_timeout_s="
            f"{ctx.config.request_timeout_s} (request {ctx.request_id})"
        )
        ctx.metrics.failed(err.kind)
    except RouterError as e:
        err = e  # counted in failures by _run_attempts
    except ClientGone:
        ctx.metrics.error("client_disconnected")
        ctx.metrics.failed("client_gone")
        logger.info("request %s: client went away mid-response", ctx.request_id)
        return ctx.client_response or web.Response(status=499), "499"
    ctx.metrics.error(err.cause)
    logger.warning("request %s failed: %s", ctx.request_id, err)
    return await reply_error(ctx, err), str(err.status)


async def _run_attempts(ctx: FlowContext, flow: Flow) -> web.StreamResponse:
    """Run ``flow``, again on other instances after each retryable failure."""
    while True:
        try:
            return await flow(ctx)
        except RouterError as err:
            ctx.metrics.failed(err.kind)
            if not _may_retry(ctx, err):
                raise
            logger.warning(
                "request %s: attempt %d of %d failed, retrying on other instances: %s",
                ctx.request_id,
                ctx.attempts.number,
                ctx.config.max_attempts,
                err,
            )
            ctx.metrics.retried()
            await ctx.next_attempt(err)


def _may_retry(ctx: FlowContext, err: RouterError) -> bool:
    """Retryable, nothing sent to a still-connected client, and every role
    still has a healthy instance the failure is not blamed on (kvpush with
    ``auto`` binding needs only a decode: with no prefill left, decode
    computes the prompt)."""
    if not ctx.attempts.may_retry(
        err,
        has_client_started=ctx.has_client_started,
        is_client_here=ctx.is_client_here,
    ):
        return False
    avoided = ctx.attempts.avoided | ctx.attempts.blame(err)
    backends = ctx.config.topology.backends
    if ctx.config.mode == "kvpush" and ctx.config.routing.binding == "auto":
        backends = tuple(b for b in backends if b.role == "decode")
    return has_every_role(backends, ctx.health.board, avoided)


# -- the flows -------------------------------------------------------------


async def colocated_flow(ctx: FlowContext) -> web.StreamResponse:
    """Forward the body unchanged to one colocated backend; relay its answer."""
    backend = ctx.pick("colocated", ctx.config.topology.colocated)
    response, first = await open_first(ctx, "colocated", backend, ctx.parsed.raw)
    return await relay(ctx, "colocated", backend, response, first)


async def pull_flow(ctx: FlowContext) -> web.StreamResponse:
    """vLLM pull: prefill first, then decode with the KV params prefill returned."""
    prefill = ctx.pick("prefill", ctx.config.topology.prefills)
    prefill_answer = await run_prefill(ctx, prefill)
    kv_params = returned_kv_params(prefill_answer, prefill)
    decode = ctx.pick("decode", ctx.config.topology.decodes)
    body = ctx.parsed.decode_body(kv_params)
    response, first = await open_first(ctx, "decode", decode, body)
    return await relay(ctx, "decode", decode, response, first)


async def push_flow(ctx: FlowContext) -> web.StreamResponse:
    """vLLM push: both legs at once, paired by vLLM through the shared
    X-Request-Id; decode is told the prefill's engine id and side channel."""

    def params(prefill: Backend, decode: Backend) -> tuple[Any, Any]:
        return None, PushDecodeParams.for_prefill(prefill, ctx.leg_request_id)

    topology = ctx.config.topology
    prefill = ctx.pick("prefill", topology.prefills)
    decode = ctx.pick("decode", topology.decodes)
    return await _concurrent_flow(ctx, params, prefill, decode)


async def kvpush_flow(ctx: FlowContext) -> web.StreamResponse:
    """kvpush: the planner (``routing.py``) chooses the decode, the binding
    and, for a prefill leg, the prefill. Skip: decode alone gets the client's
    body unchanged and computes what its prefix cache lacks (always so for a
    request asking for prompt logprobs: vLLM would load no pushed KV for
    it, ``binding.py``). Prefill: a prefill gets the client's body unchanged
    and answers alone (one token: no decode phase). Early: both legs at
    once (:func:`_early_flow`).
    Late: prefill first, then the decode chosen on the load of that moment
    (:func:`_late_flow`)."""
    if ctx.routing is None:
        raise RuntimeError("kvpush mode needs the router's Routing")
    plan = await ctx.routing.plan(ctx)
    prefill = plan.prefill
    if plan.decision.binding == "prefill" and prefill is not None:
        ctx.take(prefill)  # it alone answers: decode holds nothing after
        response, first = await open_first(ctx, "prefill", prefill, ctx.parsed.raw)
        return await relay(ctx, "prefill", prefill, response, first)
    ctx.leg_fields = _first_token_fields(ctx) if prefill is not None else {}
    served: RoutePlan | None = plan  # the decode that answered, if one did
    if prefill is None:
        ctx.take(plan.decode)
        response, first = await open_first(ctx, "decode", plan.decode, ctx.parsed.raw)
        out = await relay(ctx, "decode", plan.decode, response, first)
    elif plan.decision.binding == "late":
        out, served = await _late_flow(ctx, plan, prefill)
    else:
        ctx.take(plan.decode)
        ctx.take(prefill)
        out = await _early_flow(ctx, prefill, plan.decode)
    if served is not None:
        ctx.routing.served(served)
    return out


def _first_token_fields(ctx: FlowContext) -> dict[str, Any]:
    """The fields both legs get when the first token comes from prefill
    (none when it comes from decode: the option, or a request it cannot
    serve exactly, ``first_token.blocker``)."""
    if ctx.config.routing.first_token_from is not FirstTokenFrom.PREFILL:
        return {}
    reason = blocker(ctx.parsed)
    if reason is not None:
        logger.debug("request %s: first token from decode: %s", ctx.request_id, reason)
        return {}
    return leg_fields(ctx.parsed)


def _decode_rewrite(ctx: FlowContext) -> Callable[[bytes], bytes] | None:
    """Decode's stream as the client asked it: without the token ids the
    legs asked for when the first token was to come from prefill."""
    return DecodeEcho(ctx.parsed, None).feed if ctx.leg_fields else None


async def _first_from_prefill(
    ctx: FlowContext,
    prefill_task: asyncio.Task[bytes],
    decode_task: asyncio.Task[tuple[aiohttp.ClientResponse, bytes]],
    decode: Backend,
) -> web.StreamResponse | None:
    """Both legs in flight: once prefill answered, the client's stream opens
    with its first token and follows decode's (``first_token_flow.py``).
    None when decode answered first, prefill failed or its answer has no
    token ids: the flow goes on with decode's first token."""
    await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
    if not prefill_task.done() or prefill_task.cancelled():
        return None
    if prefill_task.exception() is not None:
        return None
    first = read_answer(prefill_task.result(), ctx.parsed)
    if first is None:
        ctx.metrics.first_token(Outcome.UNAVAILABLE.value)
        return None
    out = await stream_first(ctx, first)
    if not ctx.is_client_done:
        await follow(ctx, out, first, decode, decode_task)
    return out


async def _late_flow(
    ctx: FlowContext, plan: RoutePlan, prefill: Backend
) -> tuple[web.StreamResponse, RoutePlan | None]:
    """kvpush late binding: the prefill leg alone, naming no decode but the
    digest of a fresh claim token (one per attempt); once prefill answered
    (its KV is computed and held, under its ready deadline) the decode is
    chosen and its leg carries the token, so that decode's registration is
    the one that may claim the KV. Any failure before decode answers is the
    attempt's (a retry plans again with a fresh transfer id and token; KV a
    dead attempt left on prefill is freed at prefill's ready deadline). The
    plan it returns is the bound one, or None when no decode served it."""
    if ctx.routing is None:
        raise RuntimeError("kvpush mode needs the router's Routing")
    transfer_id, token = uuid.uuid4().hex, secrets.token_urlsafe(32)
    ctx.take(prefill)
    clients = bool(ctx.leg_fields)  # its first token is the client's
    answer = await run_prefill(
        ctx,
        prefill,
        PrefillLeg(
            transfer_id=transfer_id,
            claim_sha256=claim_digest(token),
            ends_if_stopped=clients,
            ends_at_first_token=clients and asks_one_token(ctx.parsed),
        ),
    )
    first = read_answer(answer, ctx.parsed) if ctx.leg_fields else None
    if ctx.leg_fields and first is None:
        ctx.metrics.first_token(Outcome.UNAVAILABLE.value)
    if first is not None and ends_at_first(first, ctx.parsed):
        # Whole at its first token: no decode is chosen, and prefill drops
        # the KV at once (its leg said that this ending ends the request).
        ctx.routing.unbound(ctx, plan)
        return await stream_first(ctx, first), None
    bound = ctx.routing.bind_late(ctx, plan, prefill)  # sets the headers
    client = None if first is None else await stream_first(ctx, first)
    ctx.take(bound.decode)
    leg = _decode_leg(transfer_id, prefill, claim_token=token)
    decode = bound.decode
    if client is not None and first is not None:
        # Decode continues from t1: its prompt ends with it, the KV of the
        # rest is pushed, and its first step computes t1 to sample t2.
        leg = msgspec.structs.replace(leg, num_kv_tokens=len(first.prompt_token_ids))
        body = continuation_body(ctx.parsed, first, Progress(), leg)
        path = ENDPOINT_PATHS["completions"]
        opened = open_first(ctx, "decode", decode, body, path=path)
        await follow(ctx, client, first, decode, opened, from_first=True)
        return client, bound
    opened = open_first(
        ctx, "decode", decode, ctx.parsed.decode_body(leg, ctx.leg_fields)
    )
    response, first_bytes = await opened
    out = await relay(
        ctx, "decode", decode, response, first_bytes, _decode_rewrite(ctx)
    )
    return out, bound


def _decode_leg(
    transfer_id: str, prefill: Backend, claim_token: str | None = None
) -> DecodeLeg:
    """Decode's leg of a kvpush transfer: the prefill engine and side channel
    it registers with (and, bound late, the token that claims the KV)."""
    return DecodeLeg(
        transfer_id=transfer_id,
        prefill_engine_id=prefill.engine_id,
        prefill_host=prefill.side_channel_host,
        prefill_port=prefill.side_channel_port,
        claim_token=claim_token,
        prefill_tp=prefill.tp_size,  # decode registers with each rank
    )


async def _early_flow(
    ctx: FlowContext, prefill: Backend, decode: Backend
) -> web.StreamResponse:
    """kvpush early binding: both legs at once, paired exactly by a fresh
    transfer id (one per attempt); each leg names the peer it needs (prefill:
    the decode engine it pushes to; decode: the prefill engine and side
    channel it registers with)."""
    transfer_id = uuid.uuid4().hex
    logger.debug(
        "request %s attempt %d: transfer %s",
        ctx.request_id,
        ctx.attempts.number,
        transfer_id,
    )

    def params(prefill: Backend, decode: Backend) -> tuple[Any, Any]:
        return (
            PrefillLeg(transfer_id=transfer_id, decode_engine_id=decode.engine_id),
            _decode_leg(transfer_id, prefill),
        )

    return await _concurrent_flow(ctx, params, prefill, decode)


async def _concurrent_flow(
    ctx: FlowContext,
    make_params: Callable[[Backend, Backend], tuple[Any, Any]],
    prefill: Backend,
    decode: Backend,
) -> web.StreamResponse:
    """Both legs at once, to the chosen pair; the client gets decode's answer.

    ``make_params(prefill, decode)`` gives the two legs' ``kv_transfer_params``
    (None for prefill means vLLM's ``do_remote_decode``). Whichever leg fails
    before decode produced output decides the reply (or the retry); the other
    is aborted with the attempt. Prefill's answer is read and dropped.
    """
    parsed = ctx.parsed
    prefill_params, decode_params = make_params(prefill, decode)
    prefill_task = ctx.legs.spawn(
        run_prefill(ctx, prefill, prefill_params), "prefill-leg"
    )
    decode_body = parsed.decode_body(decode_params, ctx.leg_fields)
    decode_task = ctx.legs.spawn(
        open_first(ctx, "decode", decode, decode_body), "decode-leg"
    )
    if ctx.leg_fields:
        client = await _first_from_prefill(ctx, prefill_task, decode_task, decode)
        if client is not None:
            await _settle_prefill(ctx, prefill_task)
            return client
    response, first = await _await_decode_start(ctx, prefill_task, decode_task)
    out = await relay(ctx, "decode", decode, response, first, _decode_rewrite(ctx))
    await _settle_prefill(ctx, prefill_task)
    return out


FLOWS: dict[str, Flow] = {
    "colocated": colocated_flow,
    "vllm-pull": pull_flow,
    "vllm-push": push_flow,
    "kvpush": kvpush_flow,
}


async def _await_decode_start(
    ctx: FlowContext,
    prefill_task: asyncio.Task[bytes],
    decode_task: asyncio.Task[tuple[aiohttp.ClientResponse, bytes]],
) -> tuple[aiohttp.ClientResponse, bytes]:
    """Wait (under serve's deadline) for decode's first bytes or a leg
    failure. A prefill leg whose connection was lost ends the attempt when
    another may follow (off loopback decode cannot tell a dead prefill from
    a partition and would wait for it; the aborted receive keeps its blocks
    until prefill's final word). With no retry left, kvpush's decode is left
    to fall back on its own (it recomputes the prompt once it sees the
    prefill gone, and answers or fails). vLLM's push has no such fallback,
    and a prefill that answered an error stays an error."""
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
        survivable = (
            ctx.config.mode == "kvpush"
            and isinstance(prefill_error, RouterError)
            and is_connection_lost(prefill_error)
            and not _may_retry(ctx, prefill_error)
        )
        if prefill_error is not None and not survivable:
            raise prefill_error
        if prefill_error is not None:  # counted by _settle_prefill
            logger.warning(
                "request %s: prefill leg failed (%s); decode falls back",
                ctx.request_id,
                prefill_error,
            )
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
