"""How prefill's writer tells a decode about a transfer: its final word.

Owned by the writer's :class:`~kvpush.connector.prefill.pipeline.Pipeline`
(the writer thread). A :class:`Failure` is prefill's final word on a
transfer: sent only when no WRITE of it is in flight or can still be posted
(the pipeline's job). This class only decides *where* it goes: on the
socket given (the one a Cancel came on), else on the socket the transfer's
Registration came on (decode's scheduler, which forwards it to its worker,
so it reaches decode even before any Hello), else to decode's worker (its
Hello's socket). With none known it is counted and dropped: decode's own
deadline then asks again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvpush.connector.counters import Counters
from kvpush.transfer.messages import Cause, Failure, Message

logger = logging.getLogger(__name__)

MAX_DETAIL = 1000


class Teller:
    """The reply routes of open transfers, and the Failures sent on them."""

    def __init__(
        self,
        engine_id: str,
        reply: Callable[[bytes, Message], None],
        counters: Counters,
    ) -> None:
        self._engine_id, self._reply, self._counters = engine_id, reply, counters
        self._reg_route: dict[str, bytes] = {}  # where its Registration came from

    def registered(self, tid: str, route: bytes) -> None:
        """``tid``'s Registration came on ``route`` (and was taken)."""
        self._reg_route[tid] = route

    def closed(self, tid: str) -> None:
        """``tid`` ended without a Failure (its Done told decode, or nobody
        is left to tell)."""
        self._reg_route.pop(tid, None)

    def fail(
        self,
        tid: str,
        cause: Cause,
        detail: str,
        route: bytes | None = None,
        worker_route: bytes | None = None,
    ) -> None:
        """Prefill will not write ``tid``: say so, on the first route known
        of ``route``, the Registration's, ``worker_route``."""
        logger.warning("kvpush: transfer %s failed (%s): %s", tid, cause.value, detail)
        self._counters.add(f"failed.{cause.value}")
        route = route or self._reg_route.pop(tid, None) or worker_route
        self._reg_route.pop(tid, None)
        if route is None:
            self._counters.add("failed.unroutable")
            return
        self._reply(route, Failure(tid, self._engine_id, cause, detail[:MAX_DETAIL]))

    def __len__(self) -> int:
        return len(self._reg_route)
