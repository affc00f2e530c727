"""The edge where vLLM requests become kvpush legs (scheduler side).

A request's ``kv_transfer_params`` are parsed once into a typed
:class:`~kvpush.transfer.messages.PrefillLeg` or
:class:`~kvpush.transfer.messages.DecodeLeg`: kvpush's own (a dict with
``role``, :meth:`~kvpush.transfer.messages.TransferParams.from_dict`), else
vLLM's P/D protocol (``do_remote_decode`` / ``do_remote_prefill``,
:mod:`kvpush.connector.vllm_params`), whose prefill legs also keep their
claim for prefill's answer (:meth:`Legs.vllm_prefill`). Params that do not
parse are logged, counted and ignored: the request is served locally.

One transfer id, one push. The first live request seen with a transfer id
owns it. Another request with that id while the owner lives is refused
(served locally; nothing about the owner changes: a second leg must never
overwrite the first's bookkeeping), unless ``share_ids``: then it is the
owner's *sibling* (vLLM fans a request with ``n > 1`` out into children
that carry the same ``kv_transfer_params``), it keeps its leg, and
:meth:`Legs.first_of` names its owner; what a sibling does is the role's
business (decode: :mod:`kvpush.connector.decode.scheduler`). An id whose
owner already finished is refused for good (the last
:data:`MAX_ENDED_IDS` are remembered): its push is over, and registering
it again would only be refused by prefill. Owned by the scheduler's
thread.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from kvpush.connector import vllm_params
from kvpush.connector.counters import Counters
from kvpush.connector.vllm_params import VllmPrefill
from kvpush.transfer.messages import DecodeLeg, PrefillLeg, TransferParams

logger = logging.getLogger(__name__)

Leg = PrefillLeg | DecodeLeg
MAX_ENDED_IDS = 16_384  # transfer ids of finished owners remembered (~1 MB)


class Legs:
    """Each live request's leg, by request id, and who owns each id."""

    def __init__(self, counters: Counters, share_ids: bool = False) -> None:
        self._counters = counters
        self._share_ids = share_ids
        self._legs: dict[str, Leg | None] = {}
        self._owner: dict[str, str] = {}  # transfer id -> request id
        self._first_of: dict[str, str] = {}  # sibling's request id -> owner's
        self._ended: OrderedDict[str, None] = OrderedDict()  # owner finished
        self._vllm: dict[str, VllmPrefill] = {}  # request id -> its claim

    def of(self, request: Any) -> Leg | None:
        """The request's leg (None: not a kvpush request, or refused)."""
        rid = request.request_id
        if rid not in self._legs:
            self._legs[rid] = self._parse(rid, request.kv_transfer_params)
        return self._legs[rid]

    def first_of(self, request_id: str) -> str | None:
        """The owner of a sibling's transfer id (None: not a sibling)."""
        return self._first_of.get(request_id)

    def vllm_prefill(self, request_id: str) -> VllmPrefill | None:
        """The live request's vLLM-protocol prefill leg, with its claim
        (None: not one, or refused)."""
        return self._vllm.get(request_id)

    def is_live(self, request_id: str) -> bool:
        """The request was seen here and has not finished."""
        return request_id in self._legs

    def forget(self, request_id: str) -> None:
        """The request finished; an id it owned is never taken again."""
        leg = self._legs.pop(request_id, None)
        self._first_of.pop(request_id, None)
        self._vllm.pop(request_id, None)
        if leg is not None and self._owner.get(leg.transfer_id) == request_id:
            del self._owner[leg.transfer_id]
            self._ended[leg.transfer_id] = None
            while len(self._ended) > MAX_ENDED_IDS:
                self._ended.popitem(last=False)

    def __len__(self) -> int:
        return len(self._legs)

    def _parse(self, rid: str, params: Any) -> Leg | None:
        if not params:
            return None
        try:
            parsed = _translate(params)
        except ValueError as e:
            self._counters.add("rejected.params")
            logger.warning("request %s: ignoring kv_transfer_params: %s", rid, e)
            return None
        leg = parsed.leg if isinstance(parsed, VllmPrefill) else parsed
        if not self._may_own(rid, leg.transfer_id):
            return None
        if isinstance(parsed, VllmPrefill):
            self._vllm[rid] = parsed
        return leg

    def _may_own(self, rid: str, tid: str) -> bool:
        """Whether request ``rid`` may carry transfer ``tid``: it owns a
        free id, or (``share_ids``) is a live owner's sibling."""
        owner = self._owner.get(tid)
        if owner is not None and self._share_ids:
            self._first_of[rid] = owner
            return True
        if owner is not None or tid in self._ended:
            self._counters.add("rejected.duplicate")
            logger.warning(
                "request %s: transfer id %s is already used by %s; served locally",
                rid,
                tid,
                f"request {owner}" if owner else "a request that finished",
            )
            return False
        self._owner[tid] = rid
        return True


def is_decode_leg(params: Any) -> bool:
    """``params`` ask for a decode leg (the KV comes from a prefill):
    kvpush's ``role`` ``decode``, or vLLM's ``do_remote_prefill`` alone. A
    ``kv_both`` instance sends these to its decode side and every other
    request to its prefill side, which serves it (or refuses its params)
    as a prefill-only instance would. Pure: it parses nothing else."""
    if not isinstance(params, Mapping):
        return False
    if "role" in params:
        return params["role"] == "decode"
    is_prefill, is_decode = vllm_params.legs_asked(params)
    return is_decode and not is_prefill


def _translate(params: Any) -> PrefillLeg | DecodeLeg | VllmPrefill:
    """kvpush's own params, else vLLM's; ``ValueError`` says what is wrong."""
    if vllm_params.speaks_vllm(params):
        return vllm_params.parse(params)
    return TransferParams.from_dict(params)
