"""Which backend serves each leg of a request.

The flows in ``dispatch.py`` call the router's one :class:`Selector`: a
P/D flow calls :meth:`Selector.pick_prefill` and :meth:`Selector.pick_decode`
(vLLM pull picks decode only after prefill answered, push picks both up
front); colocated mode calls :meth:`Selector.pick_decode` over the colocated
backends, since a colocated backend is the one that decodes. Selectors run
on the router's event loop only, so they need no locks, and must not block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpush.router.requests import ParsedRequest
from kvpush.topology import Backend


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
