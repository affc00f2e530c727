"""Fault injection for tests: a JSON file the connector re-reads while running.

Off unless the launcher was asked for it (``kvpush up --fault-injection``,
which sets ``kv_connector_extra_config.fault_file = RUN_DIR/faults.json``);
a production instance has no fault file and :class:`FaultSource` always
answers "no faults". The file holds one object, every key optional::

    {"drop_registrations": true,   # decode's scheduler sends no Registration
     "delay_ready_s": 2.0,         # prefill's writer holds finished KV this long
     "delay_post_s": 2.0}          # ...and a matched transfer before its WRITE

so a test can hold a transfer in one phase (before the match, or matched but
not yet written) or make a deadline pass, on a running cluster, without a
restart. A missing or unreadable file means no faults.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RECHECK_S = 0.1  # how often the file's mtime is looked at


@dataclass(frozen=True)
class Faults:
    drop_registrations: bool = False
    delay_ready_s: float = 0.0
    delay_post_s: float = 0.0

    @classmethod
    def from_dict(cls, d: object) -> Faults:
        if not isinstance(d, dict):
            raise ValueError("the fault file must hold a JSON object")
        unknown = set(d) - {"drop_registrations", "delay_ready_s", "delay_post_s"}
        if unknown:
            raise ValueError(f"unknown fault keys {sorted(unknown)}")
        faults = cls(
            drop_registrations=bool(d.get("drop_registrations", False)),
            delay_ready_s=float(d.get("delay_ready_s", 0.0)),
            delay_post_s=float(d.get("delay_post_s", 0.0)),
        )
        if faults.delay_ready_s < 0 or faults.delay_post_s < 0:
            raise ValueError("fault delays must be >= 0")
        return faults


NO_FAULTS = Faults()


class FaultSource:
    """The current :class:`Faults`, re-read when the file changes."""

    def __init__(self, path: str) -> None:
        self._path = Path(path) if path else None
        self._mtime: float | None = None
        self._checked = 0.0
        self._faults = NO_FAULTS

    def current(self) -> Faults:
        if self._path is None:
            return NO_FAULTS
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return self._faults
        self._checked = now
        try:
            mtime = self._path.stat().st_mtime
        except OSError:
            self._mtime, self._faults = None, NO_FAULTS
            return NO_FAULTS
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                self._faults = Faults.from_dict(json.loads(self._path.read_text()))
            except (OSError, ValueError) as e:
                logger.warning("kvpush: ignoring fault file %s: %s", self._path, e)
                self._faults = NO_FAULTS
            if self._faults != NO_FAULTS:
                logger.warning("kvpush: FAULT INJECTION active: %s", self._faults)
        return self._faults


class HeldBack:
    """Work the fault file holds back (writer thread): ``(kind, item)``
    pairs, each until its due time."""

    def __init__(self) -> None:
        self._items: list[tuple[float, str, Any]] = []

    def add(self, due: float, kind: str, item: Any) -> None:
        self._items.append((due, kind, item))

    def take_due(self, now: float) -> list[tuple[str, Any]]:
        due = [(k, i) for d, k, i in self._items if d <= now]
        self._items = [e for e in self._items if e[0] > now]
        return due

    def take(self, match: Callable[[str, Any], bool]) -> list[tuple[str, Any]]:
        """Remove and return the held items that ``match``."""
        taken = [(k, i) for _, k, i in self._items if match(k, i)]
        self._items = [e for e in self._items if not match(e[1], e[2])]
        return taken

    def next_due(self) -> float | None:
        return min((d for d, _, _ in self._items), default=None)

    def __len__(self) -> int:
        return len(self._items)
