"""The connector's event counters, read from each instance's ``/metrics``.

A kvpush instance's vLLM exports them as ``vllm:kvpush_events_total{event}``
(:mod:`kvpush.connector.stats`); the soak reads every instance once it has
settled, before the cluster stops (:func:`read_counters`). Other modes
export none; an instance whose metrics cannot be read is reported, not
fatal. Counts reach ``/metrics`` with the engine step after them, so an
event on an idle engine's thread may still be missing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import aiohttp
import msgspec

from kvpush.launcher.state import ProcessRecord
from kvpush.router.connector_stats import events_of
from kvpush_lab.soak.driver import read_metrics


class ConnectorCounters(msgspec.Struct, frozen=True, kw_only=True):
    """Counter totals, overall and per engine, from ``num_instances``
    instances' ``/metrics``."""

    num_instances: int = 0
    totals: dict[str, int] = msgspec.field(default_factory=dict)
    by_engine: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    unreadable: list[str] = msgspec.field(default_factory=list)


def sum_counters(
    by_engine: Mapping[str, Mapping[str, float]], unreadable: Iterable[str] = ()
) -> ConnectorCounters:
    """Totals of every counter, overall and per engine (sorted by name)."""
    totals: dict[str, int] = defaultdict(int)
    for events in by_engine.values():
        for name, count in events.items():
            totals[name] += round(count)
    return ConnectorCounters(
        num_instances=len(by_engine),
        totals=dict(sorted(totals.items())),
        by_engine={
            engine: {name: round(n) for name, n in sorted(events.items())}
            for engine, events in sorted(by_engine.items())
        },
        unreadable=list(unreadable),
    )


async def read_counters(
    session: aiohttp.ClientSession, instances: Sequence[ProcessRecord]
) -> ConnectorCounters:
    """Sum the kvpush events of every instance's ``/metrics``."""
    found: dict[str, dict[str, float]] = {}
    unreadable: list[str] = []
    for instance in instances:
        try:
            found[instance.name] = events_of(await read_metrics(session, instance.url))
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            unreadable.append(f"{instance.name}: {type(e).__name__}: {e}")
    return sum_counters(found, unreadable)
