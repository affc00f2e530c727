"""Which backend serves each leg of a request.

The flows in ``dispatch.py`` call :func:`choose`, which narrows a role's
backends to the usable ones (healthy and not drained on the
:class:`HealthBoard`, and not blamed for an earlier failed attempt of the
same request), answers 503 when none is left, and lets the router's one
:class:`Selector` pick among the rest: a P/D flow picks a prefill and a
decode (vLLM pull picks decode only after prefill answered, push picks both
up front); colocated mode picks with :meth:`Selector.pick_decode` over the
colocated backends, since a colocated backend is the one that decodes.
Everything here is pure and runs on the router's event loop only, so it
needs no locks and must not block.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from kvpush.router.errors import no_healthy_instance
from kvpush.router.health import HealthBoard
from kvpush.router.requests import ParsedRequest
from kvpush.topology import Backend, Role


class Selector(Protocol):
    """Chooses a backend from a non-empty candidate list for one request."""

    def pick_prefill(
        self, candidates: Sequence[Backend], request: ParsedRequest
    ) -> Backend:
        """Return the backend that prefills ``request``."""
        ...

    def pick_decode(
        self, candidates: Sequence[Backend], request: ParsedRequest
    ) -> Backend:
        """Return the backend that decodes (or, colocated, serves) ``request``."""
        ...


class RoundRobinSelector:
    """Cycles through prefills and decodes independently, ignoring load."""

    def __init__(self) -> None:
        self._num_prefill_picks = 0
        self._num_decode_picks = 0

    def pick_prefill(
        self, candidates: Sequence[Backend], request: ParsedRequest
    ) -> Backend:
        backend = _nth(candidates, self._num_prefill_picks, "prefill")
        self._num_prefill_picks += 1
        return backend

    def pick_decode(
        self, candidates: Sequence[Backend], request: ParsedRequest
    ) -> Backend:
        backend = _nth(candidates, self._num_decode_picks, "decode")
        self._num_decode_picks += 1
        return backend


def _nth(candidates: Sequence[Backend], n: int, role: str) -> Backend:
    if not candidates:
        raise ValueError(f"no {role} backend to choose from")
    return candidates[n % len(candidates)]


def usable(
    candidates: Sequence[Backend], health: HealthBoard, avoided: Collection[str]
) -> tuple[Backend, ...]:
    """The routable (healthy, not drained) candidates whose engine id is
    not in ``avoided``, in order."""
    return tuple(
        b
        for b in candidates
        if health.is_routable(b.engine_id) and b.engine_id not in avoided
    )


def choose(
    selector: Selector,
    role: Role,
    candidates: Sequence[Backend],
    request: ParsedRequest,
    health: HealthBoard,
    avoided: Collection[str] = (),
) -> Backend:
    """The ``role`` backend for ``request`` among the usable ``candidates``;
    raises a 503 ``RouterError`` naming the role when none is usable."""
    choices = usable(candidates, health, avoided)
    if not choices:
        raise no_healthy_instance(role, len(candidates))
    if role == "prefill":
        return selector.pick_prefill(choices, request)
    return selector.pick_decode(choices, request)


def has_every_role(
    backends: Sequence[Backend], health: HealthBoard, avoided: Collection[str]
) -> bool:
    """Whether every role among ``backends`` still has a usable backend
    (what a retry needs before it starts another attempt)."""
    roles = {b.role for b in backends}
    left = {b.role for b in usable(backends, health, avoided)}
    return roles <= left
