"""Per-transfer critical-path timestamps, and their JSONL form.

Each process records the events it sees, keyed by transfer id, and writes
its :class:`Timeline` records as JSON lines; the benchmark reads both sides'
files and :func:`merge`\\ s records of the same transfer. Which process marks
what:

=====================  ========  ============================================
event                  process   moment
=====================  ========  ============================================
``reg_sent``           decode    Registration handed to the side channel
``recv_expected``      decode    its worker took the receive (the expect)
``reg_received``       prefill   Registration decoded by the listener
``kv_ready``           prefill   prompt's last KV computed (the trigger)
``write_posted``       prefill   last WRITE of the transfer posted
``write_done``         prefill   that WRITE reported complete
``write_ended``        prefill   that WRITE ended without completing (NIXL
                                 error, or cancelled) and NIXL let go of it
``notif_received``     decode    Done notification received
``first_decode_step``  decode    first decode step scheduled after it
=====================  ========  ============================================

Timestamps are seconds from the caller's clock (``time.time()`` when both
processes share a machine; cross-machine durations need synchronised clocks).
A Timeline is mutable and owned by the one thread that records it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

EVENTS: tuple[str, ...] = (
    "reg_sent",
    "recv_expected",
    "reg_received",
    "kv_ready",
    "write_posted",
    "write_done",
    "notif_received",
    "first_decode_step",
    "write_ended",
)

# name -> (start event, end event)
DURATIONS: dict[str, tuple[str, str]] = {
    "reg_transit": ("reg_sent", "reg_received"),
    "reg_lead": ("reg_received", "kv_ready"),  # > 0: registration came first
    "post_delay": ("kv_ready", "write_posted"),
    "write": ("write_posted", "write_done"),
    "notif_delay": ("write_done", "notif_received"),
    "handover": ("kv_ready", "notif_received"),
    "decode_start": ("notif_received", "first_decode_step"),
}


@dataclass(slots=True)
class Timeline:
    """The event times of one transfer; ``None`` until marked."""

    transfer_id: str
    reg_sent: float | None = None
    recv_expected: float | None = None
    reg_received: float | None = None
    kv_ready: float | None = None
    write_posted: float | None = None
    write_done: float | None = None
    write_ended: float | None = None
    notif_received: float | None = None
    first_decode_step: float | None = None

    def mark(self, event: str, t: float) -> bool:
        """Record ``event`` at ``t``; the first mark wins (returns False for a
        repeat). ``ValueError`` for a name not in :data:`EVENTS`."""
        if event not in EVENTS:
            raise ValueError(f"unknown timeline event {event!r}; use one of {EVENTS}")
        if getattr(self, event) is not None:
            return False
        setattr(self, event, float(t))
        return True

    def duration(self, name: str) -> float | None:
        """A derived duration from :data:`DURATIONS`, or ``None`` while either
        end is missing. ``ValueError`` for an unknown name."""
        if name not in DURATIONS:
            raise ValueError(
                f"unknown duration {name!r}; use one of {tuple(DURATIONS)}"
            )
        start, end = (getattr(self, e) for e in DURATIONS[name])
        if start is None or end is None:
            return None
        return float(end - start)

    def durations(self) -> dict[str, float]:
        """Every duration whose ends are both known."""
        out = {name: self.duration(name) for name in DURATIONS}
        return {k: v for k, v in out.items() if v is not None}

    def to_dict(self) -> dict[str, Any]:
        """Transfer id plus the events that are set."""
        out: dict[str, Any] = {"transfer_id": self.transfer_id}
        out.update(
            {e: getattr(self, e) for e in EVENTS if getattr(self, e) is not None}
        )
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Timeline:
        """Inverse of :meth:`to_dict`; ``ValueError`` on unknown keys or
        non-numeric times."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a timeline record is an object, not {type(d).__name__}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown or not isinstance(d.get("transfer_id"), str):
            raise ValueError(
                f"not a timeline record (unknown keys {sorted(unknown)} "
                "or missing transfer_id)"
            )
        timeline = cls(d["transfer_id"])
        for event in EVENTS:
            value = d.get(event)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{event} must be a number, not {value!r}")
            timeline.mark(event, value)
        return timeline


def merge(a: Timeline, b: Timeline) -> Timeline:
    """One timeline from two partial records of the same transfer (e.g. the
    decode's and the prefill's). ``ValueError`` if the ids differ or both set
    an event to different times."""
    if a.transfer_id != b.transfer_id:
        raise ValueError(f"cannot merge {a.transfer_id!r} with {b.transfer_id!r}")
    out = Timeline(a.transfer_id)
    for event in EVENTS:
        x, y = getattr(a, event), getattr(b, event)
        if x is not None and y is not None and x != y:
            raise ValueError(f"{event} differs between the records: {x} vs {y}")
        value = x if x is not None else y
        if value is not None:
            out.mark(event, value)
    return out


def dumps_jsonl(timelines: Iterable[Timeline]) -> str:
    """JSON lines, one record per timeline, each ending in a newline."""
    return "".join(json.dumps(t.to_dict(), sort_keys=True) + "\n" for t in timelines)


def loads_jsonl(text: str) -> list[Timeline]:
    """Parse :func:`dumps_jsonl` output; records of the same transfer are
    merged; blank lines are skipped. ``ValueError`` names the bad line."""
    merged: dict[str, Timeline] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = Timeline.from_dict(json.loads(line))
            seen = merged.get(record.transfer_id)
            merged[record.transfer_id] = merge(seen, record) if seen else record
        except (ValueError, TypeError) as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return list(merged.values())
