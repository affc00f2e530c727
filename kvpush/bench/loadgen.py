"""Drive one sweep point: send its requests on schedule, collect records.

Poisson points are open loop (each request leaves at its planned offset,
whether or not earlier ones finished); concurrency points are closed loop
(``load`` workers, each sending its next request when the last one ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import aiohttp

from kvpush.bench import client
from kvpush.bench.records import RequestRecord
from kvpush.bench.workload import PointWorkload, RequestSpec

OnDone = Callable[[RequestRecord], None]
Send = Callable[[RequestSpec], Coroutine[Any, Any, RequestRecord]]


async def run_point(
    session: aiohttp.ClientSession,
    url: str,
    workload: PointWorkload,
    config_name: str,
    timeout_s: float,
    on_done: OnDone,
) -> list[RequestRecord]:
    """Every request of ``workload``, one record each, in index order."""
    start = time.perf_counter()

    async def one(spec: RequestSpec) -> RequestRecord:
        record = RequestRecord(
            config=config_name,
            point=workload.point.index,
            index=spec.index,
            bench_id=spec.bench_id,
            prompt_len=spec.prompt_len,
            output_len=spec.output_len,
            scheduled_s=spec.arrival_s,
        )
        await client.send(session, url, spec, record, timeout_s, start)
        on_done(record)
        return record

    if workload.point.arrival == "poisson":
        records = await _open_loop(workload, start, one)
    else:
        records = await _closed_loop(workload, one)
    return sorted(records, key=lambda r: r.index)


async def _open_loop(
    workload: PointWorkload,
    start: float,
    one: Send,
) -> list[RequestRecord]:
    tasks: list[asyncio.Task[RequestRecord]] = []
    for spec in workload.requests:
        delay = start + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec), name=spec.bench_id))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(
    workload: PointWorkload,
    one: Send,
) -> list[RequestRecord]:
    pending: Iterator[RequestSpec] = iter(workload.requests)
    records: list[RequestRecord] = []

    async def worker() -> None:
        for spec in pending:  # shared: each worker takes the next request
            records.append(await one(spec))

    num_workers = min(workload.point.concurrency, len(workload.requests))
    await asyncio.gather(*(worker() for _ in range(max(1, num_workers))))
    return records
