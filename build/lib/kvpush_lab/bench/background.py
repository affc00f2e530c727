"""The skewed workload's background load: one instance kept busy.

``background_concurrency`` plain long generations (no ``kv_transfer_params``,
``background_output_len`` tokens with ``ignore_eos``) are sent straight to
one instance's own vLLM server, bypassing the router, and kept in flight
for the whole measurement: each worker sends its next request as soon as
the last one ends. On a P/D cluster the instance is decode
``background_decode``; colocated, it is the one instance (the same load on
the only engine there is).

:class:`BackgroundLoad` and :func:`background_requests` are pure (seeded);
:func:`running` drives the load around a block of code.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvpush.launcher.state import ProcessRecord
from kvpush_lab.bench import client
from kvpush_lab.bench.config import BenchConfig
from kvpush_lab.bench.records import RequestRecord
from kvpush_lab.bench.workload import RequestSpec, random_tokens, rng_for

BACKGROUND_POINT = -2
BACKGROUND_FILE = "background.jsonl"  # its records, beside requests.jsonl
SETTLE_S = 2.0  # from the load's start to the first measured request
_STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class BackgroundLoad:
    """What keeps the target busy: requests in flight and their shape."""

    concurrency: int
    prompt_len: int
    output_len: int
    decode: int  # which decode of a P/D cluster (by index)
    seed: int
    salt: str = ""

    @classmethod
    def of(cls, config: BenchConfig, salt: str = "") -> BackgroundLoad:
        return cls(
            concurrency=config.background_concurrency,
            prompt_len=config.background_prompt_len,
            output_len=config.background_output_len,
            decode=config.background_decode,
            seed=config.seed,
            salt=salt,
        )

    def describe(self) -> str:
        return (
            f"{self.concurrency} plain requests in flight ({self.prompt_len}-token "
            f"prompts, {self.output_len} output tokens each, ignore_eos) sent "
            f"straight to decode{self.decode}'s own server (colocated: to its one "
            "instance), bypassing the router"
        )


def background_requests(
    load: BackgroundLoad, vocab: Sequence[int]
) -> Iterator[RequestSpec]:
    """An endless stream of background requests, each prompt its own draw
    (no prefix hits), the same stream for the same seed and salt."""
    rng = rng_for(load.seed, "background", load.salt)
    for i in itertools.count():
        prompt = tuple(random_tokens(load.prompt_len, vocab, rng))
        yield RequestSpec(i, f"kvb-bg-{i}", prompt, load.output_len)


def target(load: BackgroundLoad, processes: Sequence[ProcessRecord]) -> ProcessRecord:
    """The instance the load goes to: decode ``load.decode`` of a P/D
    cluster (decodes in name order), else the colocated instance
    (RuntimeError: the run fails, where the cluster has neither)."""
    decodes = sorted((p for p in processes if p.role == "decode"), key=lambda p: p.name)
    if decodes:
        if load.decode >= len(decodes):
            raise RuntimeError(
                f"no decode{load.decode}: the cluster has {len(decodes)}"
            )
        return decodes[load.decode]
    colocated = [p for p in processes if p.role == "colocated"]
    if not colocated:
        raise RuntimeError("the cluster has no decode and no colocated instance")
    return colocated[0]


@dataclass
class Driven:
    """The records of the background requests that ended, as they end; and
    of every one sent, those still in flight filling in as their tokens
    come (``started``)."""

    target: str
    records: list[RequestRecord] = field(default_factory=list)
    started: list[RequestRecord] = field(default_factory=list)

    @property
    def num_ok(self) -> int:
        return sum(r.is_ok for r in self.records)


@contextlib.asynccontextmanager
async def running(
    session: aiohttp.ClientSession,
    load: BackgroundLoad,
    instance: ProcessRecord,
    vocab: Sequence[int],
    config_name: str,
    timeout_s: float,
) -> AsyncIterator[Driven]:
    """Keep the load on ``instance`` while the block runs; the requests
    still in flight at its end are cancelled (the client disconnects, the
    server aborts them) and not recorded."""
    driven = Driven(instance.name)
    specs = background_requests(load, vocab)
    start = time.perf_counter()

    async def worker() -> None:
        for spec in specs:  # shared: each worker takes the next request
            record = RequestRecord(
                config=config_name, point=BACKGROUND_POINT, index=spec.index,
                bench_id=spec.bench_id, prompt_len=spec.prompt_len,
                output_len=spec.output_len, scheduled_s=0.0,
            )  # fmt: skip
            driven.started.append(record)
            await client.send(session, instance.url, spec, record, timeout_s, start)
            driven.records.append(record)

    tasks = [
        asyncio.create_task(worker(), name=f"background-{i}")
        for i in range(load.concurrency)
    ]
    try:
        yield driven
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=_STOP_TIMEOUT_S)
