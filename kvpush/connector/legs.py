"""The edge where vLLM requests become kvpush legs (scheduler side).

A request's ``kv_transfer_params`` are parsed once into a typed
:class:`~kvpush.transfer.messages.PrefillLeg` or
:class:`~kvpush.transfer.messages.DecodeLeg`. Params that do not parse, and
a transfer id that another live request of this instance already uses, are
logged, counted and ignored: the request is served locally, and nothing
about the first request changes (a second leg with the same id must never
overwrite the first's bookkeeping). Owned by the scheduler's thread.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpush.connector.counters import Counters
from kvpush.transfer.messages import DecodeLeg, PrefillLeg, TransferParams

logger = logging.getLogger(__name__)

Leg = PrefillLeg | DecodeLeg


class Legs:
    """Each live request's leg, by request id."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._legs: dict[str, Leg | None] = {}
        self._owner: dict[str, str] = {}  # transfer id -> request id

    def of(self, request: Any) -> Leg | None:
        """The request's leg (None: not a kvpush request, or refused)."""
        rid = request.request_id
        if rid not in self._legs:
            self._legs[rid] = self._parse(rid, request.kv_transfer_params)
        return self._legs[rid]

    def forget(self, request_id: str) -> None:
        """The request finished; its transfer id is free again."""
        leg = self._legs.pop(request_id, None)
        if leg is not None and self._owner.get(leg.transfer_id) == request_id:
            del self._owner[leg.transfer_id]

    def __len__(self) -> int:
        return len(self._legs)

    def _parse(self, rid: str, params: Any) -> Leg | None:
        if not params:
            return None
        try:
            leg = TransferParams.from_dict(params)
        except ValueError as e:
            self._counters.add("rejected.params")
            logger.warning("request %s: ignoring kv_transfer_params: %s", rid, e)
            return None
        owner = self._owner.get(leg.transfer_id)
        if owner is not None:
            self._counters.add("rejected.duplicate")
            logger.warning(
                "request %s: transfer id %s is already used by request %s; "
                "served locally",
                rid,
                leg.transfer_id,
                owner,
            )
            return None
        self._owner[leg.transfer_id] = rid
        return leg
