"""The kvpush connector's event counters, summed for the router's ``/metrics``.

Each vLLM process running the kvpush connector writes its counters to
``counters-*.json`` in the cluster's trace directory (``RUN_DIR/traces``)::

    {"engine_id": "prefill0", "role": "prefill", "pid": 1234,
     "counters": {"expired": 3, "failed.write_failed": 1}}

At every scrape, ``app.py`` calls :func:`read_counters` on that directory (off
the event loop) and appends :func:`render` of the result. Files of one engine
and role (several pids after a restart) are summed. A file that cannot be
read or decoded (a partial write, a stray file) is skipped with a debug log:
a scrape never fails because of one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from kvpush.router.metrics import LabelSet, metric_lines

logger = logging.getLogger(__name__)

FILE_GLOB = "counters-*.json"
MAX_FILE_BYTES = 1024 * 1024  # far above any real counters file
METRIC = "kvpush_connector_events_total"

EventName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9_.]{1,128}$")]
Count = Annotated[int, msgspec.Meta(ge=0)]


class CountersFile(msgspec.Struct, frozen=True):
    """One ``counters-*.json``: one connector process's counters."""

    engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    role: Literal["prefill", "decode"]
    pid: int
    counters: dict[EventName, Count]


# (engine_id, role, event) -> summed count
Totals = dict[tuple[str, str, str], int]


def read_counters(directory: Path) -> Totals:
    """Sum every readable ``counters-*.json`` in ``directory`` (none: empty)."""
    totals: Totals = {}
    try:
        paths = sorted(directory.glob(FILE_GLOB))
    except OSError as e:
        logger.debug("cannot list connector counters in %s: %s", directory, e)
        return totals
    for path in paths:
        counters = _read_file(path)
        if counters is None:
            continue
        for event, count in counters.counters.items():
            key = (counters.engine_id, counters.role, event)
            totals[key] = totals.get(key, 0) + count
    return totals


def render(totals: Totals) -> str:
    """The totals as one Prometheus counter family (empty text for none)."""
    if not totals:
        return ""
    values: dict[LabelSet, int] = {
        (("engine_id", engine_id), ("role", role), ("event", event)): count
        for (engine_id, role, event), count in totals.items()
    }
    help_text = "kvpush connector events, summed over its processes' counter files."
    return "\n".join(metric_lines(METRIC, "counter", help_text, values)) + "\n"


def _read_file(path: Path) -> CountersFile | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            logger.debug("skipping %s: larger than %d bytes", path, MAX_FILE_BYTES)
            return None
        return msgspec.json.decode(path.read_bytes(), type=CountersFile)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        logger.debug("skipping connector counters %s: %s", path, e)
        return None
