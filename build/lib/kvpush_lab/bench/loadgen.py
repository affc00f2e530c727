"""Drive one sweep point: send its requests on schedule, collect records.

Poisson points are open loop (each request leaves at its planned offset,
whether or not earlier ones finished); concurrency points are closed loop
(``load`` workers, each sending its next request when the last one ends).
Conversations (:func:`run_conversations`) are closed loop too, turn by turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import aiohttp

from kvpush_lab.bench import client
from kvpush_lab.bench.conversation import (
    FIRST_TURN_POINT,
    LATER_TURNS_POINT,
    Conversation,
    point_of,
)
from kvpush_lab.bench.records import RequestRecord
from kvpush_lab.bench.workload import PointWorkload, RequestSpec

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


async def run_conversations(
    session: aiohttp.ClientSession,
    url: str,
    conversations: Sequence[Conversation],
    num_live: int,
    config_name: str,
    timeout_s: float,
    on_done: OnDone,
) -> list[list[RequestRecord]]:
    """Every turn of every conversation, ``num_live`` conversations at a
    time, each turn sent when the last one's answer ended (its prompt holds
    that answer). Records per point (first turns, later turns), in index
    order. A failed turn's answer is taken as empty; the next turn goes on."""
    start = time.perf_counter()
    pending: Iterator[Conversation] = iter(conversations)
    records: list[RequestRecord] = []

    async def converse(conv: Conversation) -> None:
        prompt: tuple[int, ...] = conv.history
        for turn in range(1, conv.num_turns + 1):
            spec = conv.request(turn, prompt)
            record = RequestRecord(
                config=config_name, point=point_of(spec), index=spec.index,
                bench_id=spec.bench_id, prompt_len=spec.prompt_len,
                output_len=spec.output_len, scheduled_s=0.0, turn=turn,
            )  # fmt: skip
            await client.send(session, url, spec, record, timeout_s, start)
            on_done(record)
            records.append(record)
            if turn < conv.num_turns:
                prompt = conv.prompt_after(turn, prompt, record.output_token_ids)

    async def worker() -> None:
        for conv in pending:  # shared: each worker takes the next conversation
            await converse(conv)

    num_workers = max(1, min(num_live, len(conversations)))
    await asyncio.gather(*(worker() for _ in range(num_workers)))
    return [
        sorted((r for r in records if r.point == p), key=lambda r: r.index)
        for p in (FIRST_TURN_POINT, LATER_TURNS_POINT)
    ]
