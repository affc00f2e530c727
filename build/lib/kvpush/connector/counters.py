"""Event counters of one connector role object.

Every fault-handling path counts what it did (``expired.ready``,
``failed.write_failed``, ``fallback``, ``rejected.malformed``,
``quarantined.blocks``, ...; the full list is in ``docs/architecture.md``).
After every engine step vLLM asks the connector for its stats
(``get_kv_connector_stats``); those take what was added since the last take
(:meth:`Counters.take_deltas`) and vLLM's API server adds it to
``vllm:kvpush_events_total{event=...}`` on its ``/metrics``
(:mod:`kvpush.connector.stats`). Any thread may count.
"""

from __future__ import annotations

import re
import threading

_NAME = re.compile(r"^[a-z0-9_.]{1,128}$")


class Counters:
    """Thread-safe named counts: totals since start, and deltas since the
    last :meth:`take_deltas`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._deltas: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        """Count ``n`` more ``name`` events (lowercase, digits, ``_`` and ``.``)."""
        if not _NAME.match(name):
            raise ValueError(f"bad counter name {name!r}")
        if n < 0:
            raise ValueError(f"counters only grow; got {n} for {name!r}")
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n
            self._deltas[name] = self._deltas.get(name, 0) + n

    def get(self, name: str) -> int:
        """The total of ``name`` since start."""
        with self._lock:
            return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        """Every total since start."""
        with self._lock:
            return dict(self._counts)

    def take_deltas(self) -> dict[str, int]:
        """What was added since the last call (nothing: empty)."""
        with self._lock:
            deltas, self._deltas = self._deltas, {}
        return deltas
