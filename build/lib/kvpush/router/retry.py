"""When a failed attempt of a request may be tried again, and where not to.

``dispatch.py`` runs a request as one or more attempts, each a fresh run of
the mode's flow with its own legs, leg request id and (kvpush) transfer id.
After an attempt fails it asks :meth:`Attempts.may_retry`; the instances the
failure is blamed on are avoided by every later attempt of that request.
Pure: no I/O, no clock; one object per request, on the event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.router.errors import FailureKind, RouterError
from kvpush.topology import Backend

# Failures a different instance may not have: the connection, the instance
# or a leg's deadline, never the request itself (4xx) nor a router decision.
RETRYABLE_KINDS: frozenset[FailureKind] = frozenset(
    {"unreachable", "upstream_error", "timeout"}
)


@dataclass
class Attempts:
    """The attempts of one client request.

    ``number`` counts from 1; ``picked`` holds the backends the current
    attempt chose; ``avoided`` the engine ids blamed for earlier failures.
    """

    max_attempts: int
    number: int = 1
    picked: list[Backend] = field(default_factory=list)
    avoided: set[str] = field(default_factory=set)

    def leg_request_id(self, request_id: str) -> str:
        """The X-Request-Id of this attempt's legs: the request's own id first,
        then a fresh suffix per retry, so no instance sees an id twice."""
        return request_id if self.number == 1 else f"{request_id}.a{self.number}"

    def may_retry(
        self, err: RouterError, *, has_client_started: bool, is_client_here: bool
    ) -> bool:
        """Whether ``err`` ending this attempt allows another one: attempts
        are left, the failure is retryable, the client has received nothing
        yet (no status line, no byte) and is still connected."""
        return (
            self.number < self.max_attempts
            and err.kind in RETRYABLE_KINDS
            and not has_client_started
            and is_client_here
        )

    def blame(self, err: RouterError) -> set[str]:
        """The instances ``err`` is blamed on: the failed leg's backend when
        known, else every backend this attempt picked."""
        if err.backend is not None:
            return {err.backend.engine_id}
        return {b.engine_id for b in self.picked}

    def start_next(self, err: RouterError) -> None:
        """Move to the next attempt, avoiding what ``err`` is blamed on."""
        self.avoided |= self.blame(err)
        self.picked = []
        self.number += 1
