"""Preemptions waiting for WRITEs to end.

vLLM's ``handle_preemptions`` must not return while a WRITE still reads a
preempted request's blocks. The writer's
:class:`~kvpush.connector.prefill.pipeline.Pipeline` (writer thread) keeps
here, per preemption, the transfers whose WRITE was in flight and the
callback that lets the worker go on once the last of them ended. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class PreemptWaits:
    """Each waiting preemption: the WRITEs it still waits for, and ``done``."""

    def __init__(self) -> None:
        self._waits: list[tuple[set[str], Callable[[], None]]] = []

    def add(self, tids: set[str], done: Callable[[], None]) -> None:
        """Call ``done`` once every one of ``tids`` ended (now, if none)."""
        if tids:
            self._waits.append((set(tids), done))
        else:
            done()

    def ended(self, tids: Iterable[str]) -> None:
        """These transfers' WRITEs ended: wake the preemptions they held."""
        gone, still = set(tids), []
        for waiting, done in self._waits:
            waiting -= gone
            if waiting:
                still.append((waiting, done))
            else:
                done()
        self._waits = still

    def __len__(self) -> int:
        return len(self._waits)
