"""The kvpush connector's event counters, summed for the router's ``/metrics``.

Each vLLM process running the kvpush connector writes its counters to
``counters-*.json`` in the cluster's trace directory (``RUN_DIR/traces``)::

    {"engine_id": "prefill0", "role": "prefill", "pid": 1234,
     "counters": {"expired": 3, "failed.write_failed": 1}}

At every scrape, ``app.py`` calls :func:`read_counters` on that directory (off
the event loop) and appends :func:`render` of the result. Files of one engine
and role (several pids after a restart) are summed. A file that cannot be
read or decoded (a partial write, a stray file) is skipped with a debug log:
a scrape never fails because of one. The files are read, and their format
defined, by :func:`kvpush.connector.counters.read_counter_files`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvpush.connector.counters import read_counter_files
from kvpush.router.metrics import LabelSet, metric_lines

logger = logging.getLogger(__name__)

METRIC = "kvpush_connector_events_total"

# (engine_id, role, event) -> summed count
Totals = dict[tuple[str, str, str], int]


def read_counters(directory: Path) -> Totals:
    """Sum every readable ``counters-*.json`` in ``directory`` (none: empty)."""
    files, skipped = read_counter_files(directory)
    for reason in skipped:
        logger.debug("skipping connector counters %s", reason)
    totals: Totals = {}
    for f in files:
        for event, count in f.counters.items():
            key = (f.engine_id, f.role, event)
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
