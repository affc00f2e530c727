"""Which backends the router may route to: a pure record of evidence.

:class:`HealthBoard` is told about probe results (by the probing loop in
``monitor.py``), about legs that could not connect (by ``legs.py``, through
the monitor), about the operator's drains (``admin.py``) and about the
requests each backend is serving (``context.py``); the selection in
``selection.py`` reads it. It does no I/O,
keeps no clock and runs on the router's event loop only, so it needs no locks.
Each method that changes an instance's state returns the :class:`Transition`
(else None), so the caller can log and count each transition exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpush.topology import Backend


@dataclass(frozen=True)
class Transition:
    """One instance went down (``is_healthy`` False) or came back (True)."""

    backend: Backend
    is_healthy: bool
    reason: str


class HealthBoard:
    """Health of every backend of one topology, keyed by engine id.

    Every instance starts healthy (the launcher waits for ``/health`` before
    the router serves). One goes down after ``unhealthy_after`` consecutive
    failed probes, or at once when :meth:`mark_unreachable` is called; one
    successful probe brings it back.
    """

    def __init__(self, backends: Sequence[Backend], unhealthy_after: int) -> None:
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, not {unhealthy_after}")
        self.unhealthy_after = unhealthy_after
        self._backends = {b.engine_id: b for b in backends}
        self._num_failures = dict.fromkeys(self._backends, 0)
        self._is_healthy = dict.fromkeys(self._backends, True)
        self._num_in_flight = dict.fromkeys(self._backends, 0)
        self._drained: set[str] = set()

    def is_healthy(self, engine_id: str) -> bool:
        """True for a healthy instance; an unknown engine id is never healthy."""
        return self._is_healthy.get(engine_id, False)

    def is_routable(self, engine_id: str) -> bool:
        """Whether a new request may go to ``engine_id``: healthy, not drained."""
        return self.is_healthy(engine_id) and engine_id not in self._drained

    def is_drained(self, engine_id: str) -> bool:
        return engine_id in self._drained

    def set_drained(self, engine_id: str, is_drained: bool) -> None:
        """Drain (no new requests; those in flight finish) or undrain
        ``engine_id``; KeyError for an unknown one."""
        if engine_id not in self._backends:
            raise KeyError(engine_id)
        if is_drained:
            self._drained.add(engine_id)
        else:
            self._drained.discard(engine_id)

    def num_in_flight(self, engine_id: str) -> int:
        """Requests in flight that picked ``engine_id`` for one of their legs."""
        return self._num_in_flight[engine_id]

    def begin(self, engine_id: str) -> None:
        """A request picked ``engine_id``; :meth:`end` once it is done with it."""
        self._num_in_flight[engine_id] += 1

    def end(self, engine_id: str) -> None:
        if self._num_in_flight[engine_id] < 1:
            raise RuntimeError(f"{engine_id}: more requests ended than began")
        self._num_in_flight[engine_id] -= 1

    def num_failures(self, engine_id: str) -> int:
        """Consecutive failed probes (or connect failures) of an instance."""
        return self._num_failures[engine_id]

    @property
    def backends(self) -> tuple[Backend, ...]:
        return tuple(self._backends.values())

    def record_probe(
        self, engine_id: str, is_ok: bool, detail: str = ""
    ) -> Transition | None:
        """One probe of ``engine_id`` answered OK (``is_ok``) or failed."""
        if is_ok:
            self._num_failures[engine_id] = 0
            return self._set(engine_id, True, "health probe answered 200")
        self._num_failures[engine_id] += 1
        if self._num_failures[engine_id] < self.unhealthy_after:
            return None
        reason = f"{self._num_failures[engine_id]} failed health probes: {detail}"
        return self._set(engine_id, False, reason)

    def mark_unreachable(self, engine_id: str, detail: str) -> Transition | None:
        """A leg to ``engine_id`` could not connect: down now, not after probes."""
        self._num_failures[engine_id] = max(
            self._num_failures[engine_id], self.unhealthy_after
        )
        return self._set(engine_id, False, f"a request could not connect: {detail}")

    def _set(self, engine_id: str, is_healthy: bool, reason: str) -> Transition | None:
        if self._is_healthy[engine_id] == is_healthy:
            return None
        self._is_healthy[engine_id] = is_healthy
        return Transition(self._backends[engine_id], is_healthy, reason)
