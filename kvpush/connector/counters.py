"""Event counters of one connector process, exported as a JSON file.

Every fault-handling path counts what it did (``expired.ready``,
``failed.write_failed``, ``fallback``, ``rejected.malformed``, ...; the full
list is in ``docs/architecture.md``). vLLM's own ``/metrics`` has no room for
them, so each process writes its counts to
``TRACE_DIR/counters-<engine>-<pid>.json``::

    {"engine_id": "prefill0", "role": "prefill", "pid": 123,
     "counters": {"expired.ready": 1}}

The router sums these files into ``kvpush_connector_events_total`` on its
``/metrics``; tests and the soak read them too, all through
:func:`read_counter_files`. The file is rewritten
atomically at most once per :data:`FLUSH_PERIOD_S` while counts change (a
timer writes the last change even if the process goes idle), and on close.
Disabled (counting only) when no directory is set.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Annotated, Literal

import msgspec

FLUSH_PERIOD_S = 0.5
_NAME = re.compile(r"^[a-z0-9_.]+$")
COUNTERS_GLOB = "counters-*.json"
MAX_FILE_BYTES = 1024 * 1024  # far above any real counters file

EventName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9_.]{1,128}$")]
Count = Annotated[int, msgspec.Meta(ge=0)]


class CountersFile(msgspec.Struct, frozen=True):
    """One ``counters-*.json``: one connector process's counters."""

    engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    role: Literal["prefill", "decode"]
    pid: int
    counters: dict[EventName, Count]


def read_counter_files(directory: Path) -> tuple[list[CountersFile], list[str]]:
    """Every valid counters file in ``directory`` (none when it does not
    exist), and why each other one was skipped (a partial write, a stray or
    oversized file): readers never fail because of one file."""
    files: list[CountersFile] = []
    skipped: list[str] = []
    try:
        paths = sorted(directory.glob(COUNTERS_GLOB))
    except OSError as e:
        return files, [f"{directory}: {e}"]
    for path in paths:
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                skipped.append(f"{path.name}: larger than {MAX_FILE_BYTES} bytes")
                continue
            files.append(msgspec.json.decode(path.read_bytes(), type=CountersFile))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            skipped.append(f"{path.name}: {e}")
    return files, skipped


class Counters:
    """Thread-safe named counters with a rate-limited file export."""

    def __init__(self, trace_dir: str, engine_id: str, role: str) -> None:
        self._engine_id, self._role = engine_id, role
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._dirty = False
        self._last_flush = 0.0
        self._timer: threading.Timer | None = None
        self._path: Path | None = None
        if trace_dir:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            self._path = Path(trace_dir) / f"counters-{engine_id}-{os.getpid()}.json"

    def add(self, name: str, n: int = 1) -> None:
        """Count ``n`` more ``name`` events (lowercase, digits, ``_`` and ``.``)."""
        if not _NAME.match(name):
            raise ValueError(f"bad counter name {name!r}")
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n
            self._dirty = True
        self.maybe_flush()

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def maybe_flush(self, force: bool = False) -> None:
        """Write the file if counts changed and the last write is old enough
        (any thread; cheap when nothing changed)."""
        if self._path is None:
            return
        now = time.monotonic()
        with self._lock:
            if not self._dirty:
                return
            wait = FLUSH_PERIOD_S - (now - self._last_flush)
            if not force and wait > 0:
                if self._timer is None:  # flush later even if nothing else runs
                    self._timer = threading.Timer(wait, self._flush_later)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._dirty, self._last_flush = False, now
            body = {
                "engine_id": self._engine_id,
                "role": self._role,
                "pid": os.getpid(),
                "counters": dict(self._counts),
            }
            tmp = self._path.with_suffix(".tmp")
            try:
                tmp.write_text(json.dumps(body, sort_keys=True))
                tmp.replace(self._path)
            except OSError:  # counters must never break the connector
                self._dirty = True

    def _flush_later(self) -> None:
        with self._lock:
            self._timer = None
        self.maybe_flush()

    def close(self) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self.maybe_flush(force=True)
