"""The soak's I/O: send requests on schedule (aborting some), then read every
instance's KV usage until the cluster has settled.

Sending reuses the benchmark client (:func:`kvpush_lab.bench.client.send`); an
abort cancels the request's task, and leaving the response context closes
the connection mid-request (an unfinished response is never reused), which
is how the router, and vLLM behind it, learn that the client is gone.
Every wait has a deadline: each request its ``request_timeout_s``, each
metrics read :data:`METRICS_TIMEOUT_S`, the settling ``settle_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import aiohttp

from kvpush.launcher.state import ProcessRecord
from kvpush_lab.bench import client
from kvpush_lab.bench.workload import RequestSpec
from kvpush_lab.soak.leaks import (
    KvReading,
    is_settled,
    read_kv,
    router_in_flight,
    router_unhealthy,
)
from kvpush_lab.soak.outcome import SoakRecord
from kvpush_lab.soak.plan import SoakRequest

METRICS_TIMEOUT_S = 5.0
UNWIND_TIMEOUT_S = 5.0  # for an aborted request's task to close its connection
POLL_S = 0.5

MakeSpec = Callable[[SoakRequest], RequestSpec]
OnDone = Callable[[SoakRecord], None]


async def send_or_abort(
    session: aiohttp.ClientSession,
    url: str,
    spec: RequestSpec,
    record: SoakRecord,
    timeout_s: float,
    start: float,
) -> SoakRecord:
    """Send ``spec``; abort it ``record.abort_after_s`` after the send if it
    is still running then (``record.is_aborted`` says whether it was)."""
    sending = client.send(session, url, spec, record, timeout_s, start)
    if record.abort_after_s is None:
        await sending
        return record
    task = asyncio.create_task(sending, name=spec.bench_id)
    done, _ = await asyncio.wait({task}, timeout=record.abort_after_s)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=UNWIND_TIMEOUT_S)
    if task.done() and not task.cancelled():  # it ended before the abort
        return record
    record.is_aborted = True
    record.end_s = time.perf_counter() - start - record.sent_s
    return record


async def drive(
    session: aiohttp.ClientSession,
    url: str,
    requests: Sequence[SoakRequest],
    make_spec: MakeSpec,
    window_s: float,
    timeout_s: float,
    mode: str,
    on_done: OnDone,
) -> list[SoakRecord]:
    """Send every request at its arrival time (open loop) and wait for all
    to end; one record each, in index order. Aborts come ``abort_at`` of
    ``window_s`` after the send."""
    start = time.perf_counter()

    async def one(request: SoakRequest) -> SoakRecord:
        spec = make_spec(request)
        record = SoakRecord(
            config=mode,
            point=0,
            index=request.index,
            bench_id=request.bench_id,
            prompt_len=spec.prompt_len,
            output_len=spec.output_len,
            scheduled_s=request.arrival_s,
            abort_after_s=request.abort_after_s(window_s),
        )
        await send_or_abort(session, url, spec, record, timeout_s, start)
        on_done(record)
        return record

    tasks: list[asyncio.Task[SoakRecord]] = []
    for request in requests:
        delay = start + request.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request), name=request.bench_id))
    return sorted(await asyncio.gather(*tasks), key=lambda r: r.index)


async def read_metrics(session: aiohttp.ClientSession, url: str) -> str:
    """The text of ``url/metrics``; raises on any failure."""
    timeout = aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S)
    async with session.get(f"{url}/metrics", timeout=timeout) as resp:
        resp.raise_for_status()
        return await resp.text()


async def read_instance(
    session: aiohttp.ClientSession, instance: ProcessRecord
) -> KvReading:
    try:
        text = await read_metrics(session, instance.url)
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        reason = f"{type(e).__name__}: {e}".rstrip(": ")
        return KvReading(name=instance.name, role=instance.role, error=reason)
    return read_kv(instance.name, instance.role, text)


async def read_router(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        return router_in_flight(await read_metrics(session, url))
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None


async def wait_routable(
    session: aiohttp.ClientSession, router_url: str, timeout_s: float
) -> list[str]:
    """Wait until the router routes to every instance (its health gauge up
    everywhere, or no such gauge), at most ``timeout_s``: the instances
    still marked down then."""
    started = time.monotonic()
    while True:
        try:
            down = router_unhealthy(await read_metrics(session, router_url)) or []
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            down = [f"router metrics unreadable: {type(e).__name__}"]
        waited = time.monotonic() - started
        if not down or waited >= timeout_s:
            return down
        await asyncio.sleep(min(POLL_S, timeout_s - waited))


async def settle(
    session: aiohttp.ClientSession,
    instances: Sequence[ProcessRecord],
    router_url: str,
    settle_s: float,
) -> tuple[list[KvReading], int | None, float]:
    """Read every instance until all are idle with no block in use, or
    ``settle_s`` has passed: the last readings, then the router's in-flight
    count, and the seconds waited."""
    started = time.monotonic()
    while True:
        readings = list(
            await asyncio.gather(*(read_instance(session, i) for i in instances))
        )
        waited = time.monotonic() - started
        if is_settled(readings) or waited >= settle_s:
            return readings, await read_router(session, router_url), waited
        await asyncio.sleep(min(POLL_S, settle_s - waited))
