"""Per-transfer timeline events: timed for ``/metrics``, and traced to a file.

Every connector role object owns one :class:`Tracer` and marks each event
of :mod:`kvpush.transfer.timeline` it sees. Each mark goes to the tracer's
:class:`~kvpush.connector.phases.PhaseClock` (monotonic time; the phase
durations that :meth:`Tracer.take_phases` hands to the connector's stats
for vLLM's ``/metrics``) and, when a trace directory is set, to this
process's file ``TRACE_DIR/<engine>-<pid>.jsonl``, one line per event:
``{"transfer_id", "event", "t", "engine_id", ...}``. ``t`` is wall-clock
seconds (``time.time()``), comparable across processes of one machine; the
benchmark joins the files by transfer id.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvpush.connector.phases import PhaseClock, PhaseObservations
from kvpush.transfer.timeline import EVENTS


class Tracer:
    """Times and (optionally) traces timeline events; thread-safe."""

    def __init__(
        self, trace_dir: str, engine_id: str, clock: PhaseClock | None = None
    ) -> None:
        self._engine_id = engine_id
        self._lock = threading.Lock()
        self._clock = clock if clock is not None else PhaseClock()
        self._file = None
        if trace_dir:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            path = Path(trace_dir) / f"{engine_id}-{os.getpid()}.jsonl"
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 (owned; close())

    def mark(self, transfer_id: str, event: str, **extra: Any) -> None:
        """Record that ``event`` happened to ``transfer_id`` now. Keywords the
        phase clock reads: ``peer`` (the other engine's id), and on
        ``write_posted`` ``num_bytes`` and ``num_descs``."""
        if event not in EVENTS:
            raise ValueError(f"unknown timeline event {event!r}")
        now = time.monotonic()
        line = None
        if self._file is not None:
            record = {"transfer_id": transfer_id, "event": event, "t": time.time()}
            line = json.dumps({**record, "engine_id": self._engine_id, **extra})
        with self._lock:
            self._clock.mark(transfer_id, event, now, extra)
            if line is not None and self._file is not None:
                self._file.write(line + "\n")

    def take_phases(self) -> PhaseObservations:
        """The phases timed since the last call (see ``PhaseClock.take``)."""
        with self._lock:
            return self._clock.take(time.monotonic())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
