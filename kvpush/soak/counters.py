"""The connector's event counters, summed over its processes.

Each kvpush connector process may write ``RUN_DIR/traces/counters-*.json``::

    {"engine_id": "prefill0", "role": "prefill", "pid": 123,
     "counters": {"expired.ready": 1}}

(rewritten as counts change and on close, so the soak reads them once the
cluster has stopped; read with
:func:`kvpush.connector.counters.read_counter_files`). Other modes write
none; a file that cannot be read is reported, not fatal.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import msgspec

from kvpush.connector.counters import CountersFile, read_counter_files


class ConnectorCounters(msgspec.Struct, frozen=True, kw_only=True):
    """Counter totals, overall and per engine, from ``num_files`` files."""

    num_files: int = 0
    totals: dict[str, int] = msgspec.field(default_factory=dict)
    by_engine: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    unreadable: list[str] = msgspec.field(default_factory=list)


def sum_counters(
    files: Iterable[CountersFile], unreadable: Iterable[str] = ()
) -> ConnectorCounters:
    """Totals of every counter, overall and per engine (sorted by name)."""
    totals: dict[str, int] = defaultdict(int)
    by_engine: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    num_files = 0
    for f in files:
        num_files += 1
        for name, count in f.counters.items():
            totals[name] += count
            by_engine[f.engine_id][name] += count
    return ConnectorCounters(
        num_files=num_files,
        totals=dict(sorted(totals.items())),
        by_engine={e: dict(sorted(c.items())) for e, c in sorted(by_engine.items())},
        unreadable=list(unreadable),
    )


def read_counters(trace_dir: Path) -> ConnectorCounters:
    """Sum every counter file in ``trace_dir`` (none: empty totals)."""
    return sum_counters(*read_counter_files(trace_dir))
