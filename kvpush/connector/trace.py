"""Per-transfer timeline events, appended as JSON lines.

Each process that marks events (decode's scheduler and worker, prefill's
worker and its threads) writes its own file ``TRACE_DIR/<engine>-<pid>.jsonl``
with one line per event: ``{"transfer_id", "event", "t", "engine_id", ...}``.
``t`` is wall-clock seconds (``time.time()``), comparable across processes of
one machine. :mod:`kvpush.transfer.timeline` names the events; the benchmark
joins the files by transfer id. Disabled (a no-op) when no directory is set.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvpush.transfer.timeline import EVENTS


class Tracer:
    """Appends timeline events to this process's trace file; thread-safe."""

    def __init__(self, trace_dir: str, engine_id: str) -> None:
        self._engine_id = engine_id
        self._lock = threading.Lock()
        self._file = None
        if trace_dir:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            path = Path(trace_dir) / f"{engine_id}-{os.getpid()}.jsonl"
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 (owned; close())

    def mark(self, transfer_id: str, event: str, **extra: Any) -> None:
        """Record that ``event`` happened to ``transfer_id`` now."""
        if self._file is None:
            return
        if event not in EVENTS:
            raise ValueError(f"unknown timeline event {event!r}")
        line = {"transfer_id": transfer_id, "event": event, "t": time.time()}
        line.update(engine_id=self._engine_id, **extra)
        with self._lock:
            self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
