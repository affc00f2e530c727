"""Handover phases timed inside one process, from its tracer's marks: pure.

Every :meth:`~kvpush.connector.trace.Tracer.mark` also goes to the tracer's
:class:`PhaseClock`, with a monotonic time. The clock times a phase only
when it saw both of its ends itself, so no duration is ever one process's
clock minus another's. Which tracer sees what (events of
:mod:`kvpush.transfer.timeline`):

===============  =========================================  ================
phase            from -> to                                 whose tracer
===============  =========================================  ================
``registration`` first of ``kv_ready``/``reg_received`` ->  prefill worker
                 the other one (the match)
``write_setup``  the match -> ``write_posted``              prefill worker
``transfer``     ``write_posted`` -> ``write_done``         prefill worker
``push``         ``kv_ready`` -> ``write_done``             prefill worker
``handover``     ``recv_expected`` -> ``notif_received``    decode worker
``decode_wait``  ``reg_sent`` -> ``first_decode_step``      decode scheduler
===============  =========================================  ================

Each event counts at its first mark (as in :class:`~kvpush.transfer.timeline.Timeline`).
``push`` and ``handover`` are also kept per peer engine (the ``peer``
keyword of any mark of the transfer), prefill's from the match
(:data:`PEER_STARTS`). Every ``write_posted`` mark gives one WRITE's
size (its ``num_bytes`` and ``num_descs`` keywords) and adds its bytes to
its peer's bytes in flight until ``write_done``. A transfer that never ends
(aborted, failed) is forgotten :data:`MAX_AGE_S` after its first mark, its
bytes in flight with it. Not thread-safe: the tracer serialises calls.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

MATCHED = "matched"  # derived: the later of kv_ready and reg_received
MAX_AGE_S = 600.0  # a transfer unfinished this long after its first mark is dropped
MAX_TRANSFERS = 100_000  # hard cap on transfers followed at once (oldest dropped)


class Phase(enum.StrEnum):
    REGISTRATION = "registration"
    WRITE_SETUP = "write_setup"
    TRANSFER = "transfer"
    PUSH = "push"
    HANDOVER = "handover"
    DECODE_WAIT = "decode_wait"


# phase -> (the earliest of these events starts it, this event ends it)
PHASES: dict[Phase, tuple[tuple[str, ...], str]] = {
    Phase.REGISTRATION: (("kv_ready", "reg_received"), MATCHED),
    Phase.WRITE_SETUP: ((MATCHED,), "write_posted"),
    Phase.TRANSFER: (("write_posted",), "write_done"),
    Phase.PUSH: (("kv_ready",), "write_done"),
    Phase.HANDOVER: (("recv_expected",), "notif_received"),
    Phase.DECODE_WAIT: (("reg_sent",), "first_decode_step"),
}
# The figure kept per peer engine: the phase that ends it, and the event it
# starts from. On prefill it starts at the match, not at ``kv_ready``: bound
# late, decode registers only after the router chose it, once the KV was
# ready, and that wait is not the pair's transfer (the router weighs this
# figure as the pair's cost; counting the wait made every pair it had
# measured look slower than one it had not).
PEER_STARTS: dict[Phase, str] = {Phase.PUSH: MATCHED, Phase.HANDOVER: "recv_expected"}


@dataclass
class PhaseObservations:
    """What a clock measured since the last :meth:`PhaseClock.take`.

    ``bytes_in_flight`` holds only the peers whose value changed (a gauge:
    the latest value is the truth)."""

    phases: dict[Phase, list[float]] = field(default_factory=dict)
    peer_handovers: dict[str, list[float]] = field(default_factory=dict)
    write_bytes: list[int] = field(default_factory=list)
    write_descs: list[int] = field(default_factory=list)
    bytes_in_flight: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (
            self.phases
            or self.peer_handovers
            or self.write_bytes
            or self.write_descs
            or self.bytes_in_flight
        )


@dataclass
class _Transfer:
    first_t: float
    times: dict[str, float] = field(default_factory=dict)
    peer: str | None = None
    num_bytes_in_flight: int = 0
    ended: set[Phase] = field(default_factory=set)


class PhaseClock:
    """Times the phases of :data:`PHASES` from one tracer's marks."""

    def __init__(
        self, max_age_s: float = MAX_AGE_S, max_transfers: int = MAX_TRANSFERS
    ) -> None:
        if max_age_s <= 0 or max_transfers < 1:
            raise ValueError("max_age_s must be > 0 and max_transfers >= 1")
        self._max_age_s, self._max_transfers = max_age_s, max_transfers
        self._transfers: dict[str, _Transfer] = {}  # insertion order: oldest first
        self._in_flight: dict[str, int] = {}  # peer -> bytes posted, not done
        self._out = PhaseObservations()

    def mark(
        self, transfer_id: str, event: str, t: float, extra: Mapping[str, Any]
    ) -> None:
        """``event`` happened to ``transfer_id`` at monotonic time ``t``."""
        if event == "write_ended":  # never landed: its bytes leave the gauge
            if transfer_id in self._transfers:
                self._forget(transfer_id)
            return
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            self._make_room()
            transfer = self._transfers[transfer_id] = _Transfer(first_t=t)
        if transfer.peer is None and isinstance(extra.get("peer"), str):
            transfer.peer = extra["peer"]
        if event == "write_posted":
            self._write_posted(transfer, extra)
        elif event == "write_done":
            self._land(transfer)
        if event in transfer.times:
            return
        transfer.times[event] = t
        times = transfer.times
        if MATCHED not in times and "kv_ready" in times and "reg_received" in times:
            times[MATCHED] = t
        self._end_phases(transfer)
        if self._is_over(transfer):
            del self._transfers[transfer_id]

    def take(self, now: float) -> PhaseObservations:
        """Everything measured since the last call; forgets transfers older
        than the maximum age first."""
        while self._transfers:
            tid, oldest = next(iter(self._transfers.items()))
            if now - oldest.first_t <= self._max_age_s:
                break
            self._forget(tid)
        out, self._out = self._out, PhaseObservations()
        return out

    @property
    def num_transfers(self) -> int:
        """Transfers followed now (started, not over, not yet forgotten)."""
        return len(self._transfers)

    def _write_posted(self, transfer: _Transfer, extra: Mapping[str, Any]) -> None:
        num_bytes, num_descs = extra.get("num_bytes"), extra.get("num_descs")
        if _is_count(num_descs):
            self._out.write_descs.append(num_descs)
        if _is_count(num_bytes):
            self._out.write_bytes.append(num_bytes)
            transfer.num_bytes_in_flight += num_bytes
            self._add_in_flight(transfer.peer, num_bytes)

    def _land(self, transfer: _Transfer) -> None:
        self._add_in_flight(transfer.peer, -transfer.num_bytes_in_flight)
        transfer.num_bytes_in_flight = 0

    def _add_in_flight(self, peer: str | None, num_bytes: int) -> None:
        if num_bytes == 0:
            return
        key = peer or ""
        value = self._in_flight[key] = self._in_flight.get(key, 0) + num_bytes
        self._out.bytes_in_flight[key] = value

    def _end_phases(self, transfer: _Transfer) -> None:
        times = transfer.times
        for phase, (starts, end) in PHASES.items():
            if phase in transfer.ended or end not in times:
                continue
            seen = [times[s] for s in starts if s in times]
            if not seen:
                continue
            transfer.ended.add(phase)
            seconds = max(0.0, times[end] - min(seen))
            self._out.phases.setdefault(phase, []).append(seconds)
            start = PEER_STARTS.get(phase)
            if start in times and transfer.peer:
                peer_s = max(0.0, times[end] - times[start])
                self._out.peer_handovers.setdefault(transfer.peer, []).append(peer_s)

    @staticmethod
    def _is_over(transfer: _Transfer) -> bool:
        """Every phase this tracer started has ended."""
        times = transfer.times
        return all(
            phase in transfer.ended or not any(s in times for s in starts)
            for phase, (starts, _) in PHASES.items()
        )

    def _make_room(self) -> None:
        while len(self._transfers) >= self._max_transfers:
            self._forget(next(iter(self._transfers)))

    def _forget(self, transfer_id: str) -> None:
        self._land(self._transfers.pop(transfer_id))


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
