"""Per-request server timelines: the handover between prefill and decode.

**What a configuration may expose.** Any process of a cluster may append JSON
Lines files under ``<run_dir>/traces/`` (``*.jsonl``; kvpush's connector
writes one per process, ``<engine>-<pid>.jsonl``). A line is either one
event, as kvpush's connector writes them::

    {"transfer_id": "9b58...", "event": "kv_ready", "t": 1718000000.1234, ...}

or several events of one transfer at once::

    {"transfer_id": "9b58...", "kv_ready": 1718000000.1234, "write_done": ...}

Events are those of :data:`kvpush.transfer.timeline.EVENTS` (``reg_sent``,
``reg_received``, ``kv_ready``, ``write_posted``, ``write_done``,
``notif_received``, ``first_decode_step``), timestamps in seconds since the
epoch (``time.time()``, one host clock). Lines are grouped by
``transfer_id`` (or ``request_id`` when there is none); other keys are
ignored, and an event seen twice keeps its earliest time, except
``write_posted``: a streamed transfer (push granularity ``chunk`` or
``layer``) posts a WRITE per item, and the phases time its last one, as
:mod:`kvpush.transfer.timeline` defines the event (so "write setup" may be
below zero where the last WRITE went out before ``kv_ready``: per layer).

**Joining with the client's requests.** A group belongs to a benchmark
request when its id, or a ``request_id`` on any of its lines, contains the
request's ``X-Request-Id`` (``kvb-<point>-<index>``; the router keeps it as
the prefix of the id it forwards, and vLLM's request ids contain that). A
group that names no request is attributed to the sweep point during whose
wall-clock window its first event happened: enough for per-point phase
statistics, not for per-request plots. vLLM's own connectors write nothing,
so for them the benchmark reports the client's view only.

Pure apart from :func:`read_timelines`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from kvpush.transfer.timeline import EVENTS
from kvpush_lab.bench.stats import Dist
from kvpush_lab.bench.trace_files import TRACE_DIR

MATCHED = "matched"  # derived: both the KV and the registration are there
LATEST = ("write_posted",)  # events whose last mark counts (one per WRITE)

# (phase, from event, to event), in the order they happen. The handover runs
# from kv_ready to first_decode_step; "registration" overlaps prefill.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("registration", "reg_sent", "reg_received"),
    ("await registration", "kv_ready", MATCHED),
    ("write setup", MATCHED, "write_posted"),
    ("transfer", "write_posted", "write_done"),
    ("notify", "write_done", "notif_received"),
    ("schedule decode", "notif_received", "first_decode_step"),
    ("handover total", "kv_ready", "first_decode_step"),
)
_BENCH_ID = re.compile(r"(?<![A-Za-z0-9])(kvb-(?:w|\d+)-\d+)(?![0-9])")

Timeline = dict[str, float]
JoinedBy = Literal["request id", "time window"]


def bench_id_of(text: str) -> str | None:
    """The benchmark id inside a server-side id, if any."""
    match = _BENCH_ID.search(text)
    return match.group(1) if match else None


@dataclass
class TimelineSet:
    """Timelines joined to benchmark requests, and those that name none."""

    by_request: dict[str, Timeline] = field(default_factory=dict)
    unjoined: list[Timeline] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.by_request or self.unjoined)


def parse_line(obj: Any) -> tuple[str, list[str], Timeline]:
    """(group key, ids that may name a request, events) of one decoded line;
    ValueError for anything else."""
    if not isinstance(obj, dict):
        raise ValueError("a trace line must be a JSON object")
    key = obj.get("transfer_id", obj.get("request_id"))
    if not isinstance(key, str):
        raise ValueError("a trace line needs a string transfer_id or request_id")
    ids = [v for v in (key, obj.get("request_id")) if isinstance(v, str)]
    events = {n: float(obj[n]) for n in EVENTS if _is_time(obj.get(n))}
    if obj.get("event") in EVENTS and _is_time(obj.get("t")):
        events[obj["event"]] = float(obj["t"])
    return key, ids, events


def _is_time(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def collect(lines: Iterable[tuple[str, list[str], Timeline]]) -> TimelineSet:
    """Group parsed lines by key (earliest time of each event wins) and join
    each group to the benchmark request its ids name, if any."""
    groups: dict[str, Timeline] = {}
    names: dict[str, str] = {}
    for key, ids, events in lines:
        group = groups.setdefault(key, {})
        for name, t in events.items():
            keep = max if name in LATEST else min
            group[name] = keep(t, group.get(name, t))
        for text in ids:
            if (bench_id := bench_id_of(text)) is not None:
                names[key] = bench_id
    out = TimelineSet()
    for key, group in groups.items():
        if key in names:
            out.by_request[names[key]] = group
        elif group:
            out.unjoined.append(group)
    return out


def read_timelines(run_dir: Path) -> TimelineSet:
    """Every trace a cluster wrote under ``run_dir/traces`` (empty when the
    configuration writes none). ValueError names a malformed line."""
    folder = run_dir / TRACE_DIR
    parsed = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                parsed.append(parse_line(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as e:
                raise ValueError(f"{path}:{number}: {e}") from e
    return collect(parsed)


def match_by_time(
    unjoined: Sequence[Timeline], spans: Mapping[str, tuple[float, float]]
) -> dict[str, Timeline]:
    """Pair unjoined timelines with requests where time leaves no doubt: a
    timeline whose first event lies in exactly one request's span (send to
    first token, epoch seconds), that span holding no other. For drawing;
    statistics use :func:`point_timelines`."""
    hits: dict[str, list[Timeline]] = {}
    for timeline in unjoined:
        first = min(timeline.values())
        owners = [b for b, (start, end) in spans.items() if start <= first <= end]
        if len(owners) == 1:
            hits.setdefault(owners[0], []).append(timeline)
    return {b: found[0] for b, found in hits.items() if len(found) == 1}


def phase_durations(timeline: Mapping[str, float]) -> dict[str, float]:
    """Seconds spent in each phase whose two ends the timeline has."""
    events = dict(timeline)
    if "kv_ready" in events and "reg_received" in events:
        events[MATCHED] = max(events["kv_ready"], events["reg_received"])
    return {
        phase: events[end] - events[start]
        for phase, start, end in PHASES
        if start in events and end in events
    }


class HandoverStats(msgspec.Struct, frozen=True, kw_only=True):
    """Phase durations (ms) of one point's transfers: ``num_requests`` of
    them for ``num_measured`` requests, attributed by ``joined_by``."""

    num_requests: int
    num_measured: int
    joined_by: JoinedBy = "request id"
    phases_ms: dict[str, Dist]


def point_timelines(
    timelines: TimelineSet, bench_ids: Sequence[str], window: tuple[float, float]
) -> tuple[list[Timeline], JoinedBy]:
    """A point's timelines: those joined to its requests, else the unjoined
    ones whose first event falls in its wall-clock ``window``."""
    joined = [timelines.by_request[b] for b in bench_ids if b in timelines.by_request]
    if joined:
        return joined, "request id"
    start, end = window
    in_window = [t for t in timelines.unjoined if start <= min(t.values()) <= end]
    return in_window, "time window"


def summarize_handover(
    timelines: TimelineSet, bench_ids: Sequence[str], window: tuple[float, float]
) -> HandoverStats | None:
    """Phase statistics of one point (None when it has no timelines)."""
    found, joined_by = point_timelines(timelines, bench_ids, window)
    if not found:
        return None
    per_phase: dict[str, list[float]] = {}
    for timeline in found:
        for phase, seconds in phase_durations(timeline).items():
            per_phase.setdefault(phase, []).append(1000 * seconds)
    phases = {
        phase: dist
        for phase, _, _ in PHASES
        if (dist := Dist.of(per_phase.get(phase, []))) is not None
    }
    return HandoverStats(
        num_requests=len(found),
        num_measured=len(bench_ids),
        joined_by=joined_by,
        phases_ms=phases,
    )
