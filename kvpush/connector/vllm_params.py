"""vLLM's own P/D request protocol, translated into kvpush legs (pure).

Routers written for vLLM's ``NixlConnector`` (vLLM's toy pull and push
proxies, llm-d's routing sidecar, vllm-router) put these
``kv_transfer_params`` on a request's two legs:

* prefill: ``{"do_remote_decode": true, "do_remote_prefill": false, ...}``
  (the other ``remote_*`` keys null), and, from a router that sends both
  legs at once, its own ``transfer_id``;
* decode: ``{"do_remote_prefill": true, "remote_engine_id", "remote_host",
  "remote_port", "tp_size", "remote_request_id"}``, taken from prefill's
  answer (:meth:`VllmPrefill.answer`: the pull proxy forwards it whole, the
  push proxy only those five fields), or, from a concurrent router, the
  prefill's address from its own configuration and the same
  ``transfer_id`` as the prefill leg.

kvpush serves both as a late-bound transfer. The pairing secret is a
*claim* ``C``: the router's ``transfer_id``, which must then be a
:data:`~kvpush.transfer.messages.ClaimToken` (32 to 128 URL-safe
characters: a uuid4, hex or not, is one) not starting with
:data:`~kvpush.transfer.matcher.PREFILL_CLAIM_PREFIX`; else, when the leg
carries none, drawn by prefill: that prefix and 256 random bits
(:func:`new_claim`). The prefill leg is a
:class:`PrefillLeg` with ``claim_sha256`` = SHA-256(C); decode's
:class:`DecodeLeg` carries ``claim_token`` = C (its ``transfer_id``, else
its ``remote_request_id``). Both sides name the transfer
:func:`transfer_id_of` (C): a digest of C, so logs, traces and metrics
never show the claim, and a forged C names a transfer that does not exist
(it can neither claim nor close anyone else's). One claim, one transfer:
prefill's matcher lets one decode claim it, once
(:mod:`kvpush.transfer.matcher`).

A claim prefill drew reaches a decode only after every worker rank
queued its ready KV for the writer, ahead of any registration bearing
it; this is why the matcher refuses at once a registration bearing such
a claim that it holds no KV for (one bearing a router-set claim may come
first, and waits). The order, for a claim ``C`` drawn for request ``R``:

1. prefill's scheduler gives ``C`` out only in ``request_finished``'s
   answer, and only once ``R``'s last trigger went to the workers, in the
   connector metadata of some step ``N`` (its first trigger, which opens
   the transfer, in a step no later);
2. on each TP rank, the worker puts each trigger on its writer's inbox
   (:meth:`~kvpush.connector.prefill.writer.Writer.kv_ready`) in that
   step's ``wait_for_save`` (a chunk pushed per layer: in ``bind``,
   before the forward), before the rank returns the step's output (with
   speculative decoding vLLM defers ``wait_for_save`` to the end of
   ``sample_tokens``, still before the output);
3. vLLM's scheduler finishes ``R`` with a response only in
   ``update_from_output`` of step ``N`` or later, which needs that step's
   output; with a KV connector the executor collects it from every rank
   (``KVOutputAggregator``), so every rank's step ``N`` trigger is on its
   inbox by then (an abort's ``request_finished`` answers no router);
4. the router sends ``C`` to a decode after that response; the decode's
   registration reaches each rank's listener, which puts it on the same
   FIFO inbox, behind the trigger; the writer thread takes events in
   order, so the ready KV is in the matcher (pending, or matched or
   closed under a tombstone) before the registration is handled.

Only fault injection breaks step 4 on purpose: ``delay_ready_s`` holds
the ready KV back from the matcher, so a prefill-drawn claim that comes
within the delay is refused (decode computes the prompt itself).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from kvpush.transfer.matcher import PREFILL_CLAIM_PREFIX, is_prefill_claim
from kvpush.transfer.messages import DecodeLeg, PrefillLeg, claim_digest
from kvpush.transfer.ranks import MAX_TP_SIZE

TRANSFER_ID_PREFIX = "vllm-"  # kvpush's transfer ids for vLLM-protocol legs
TRANSFER_MODE = "push"  # what prefill's answer says (vLLM's push connector too)
_CLAIM = re.compile(r"^[A-Za-z0-9_-]{32,128}$")  # ClaimToken's pattern
_FLAGS = ("do_remote_decode", "do_remote_prefill")
_L = TypeVar("_L", PrefillLeg, DecodeLeg)


def speaks_vllm(params: Any) -> bool:
    """``params`` is a vLLM P/D dict (it names ``do_remote_decode`` or
    ``do_remote_prefill``) and not kvpush's own (no ``role``)."""
    return (
        isinstance(params, Mapping)
        and "role" not in params
        and any(flag in params for flag in _FLAGS)
    )


def transfer_id_of(claim: str) -> str:
    """kvpush's transfer id for the transfer claimed by ``claim``: both
    sides derive it; it does not reveal the claim."""
    return TRANSFER_ID_PREFIX + hashlib.sha256(claim.encode()).hexdigest()[:32]


def new_claim() -> str:
    """A fresh, unguessable claim (256 random bits), of the form only
    prefill draws (:func:`~kvpush.transfer.matcher.is_prefill_claim`)."""
    return PREFILL_CLAIM_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class VllmPrefill:
    """A vLLM-protocol prefill leg: kvpush's late-bound ``leg``, its
    ``claim``, and whether the router chose the claim (its ``transfer_id``:
    it sends the decode leg at once) or prefill drew it (the router learns
    it from prefill's answer)."""

    leg: PrefillLeg
    claim: str
    is_router_set: bool

    def answer(
        self, engine_id: str, host: str, port: int, tp_size: int
    ) -> dict[str, Any]:
        """The ``kv_transfer_params`` prefill's response carries: what a
        decode leg needs (vLLM's names), the claim as ``remote_request_id``
        (and as ``transfer_id`` when the router set it)."""
        answer: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": tp_size,
            "remote_request_id": self.claim,
            "transfer_mode": TRANSFER_MODE,
        }
        if self.is_router_set:
            answer["transfer_id"] = self.claim
        return answer


def legs_asked(params: Mapping[str, Any]) -> tuple[bool, bool]:
    """Whether a vLLM P/D dict asks for (a prefill leg, a decode leg):
    ``do_remote_decode``, ``do_remote_prefill`` true. A valid one asks for
    exactly one."""
    return (
        params.get("do_remote_decode") is True,
        params.get("do_remote_prefill") is True,
    )


def parse(
    params: Mapping[str, Any], draw: Callable[[], str] = new_claim
) -> VllmPrefill | DecodeLeg:
    """The leg a vLLM P/D dict asks for (``draw`` makes a prefill leg's
    claim when the router set none); ``ValueError`` says what is wrong."""
    is_prefill, is_decode = legs_asked(params)
    if is_prefill == is_decode:
        raise _invalid(
            "exactly one of do_remote_decode (prefill leg) and "
            "do_remote_prefill (decode leg) must be true, not "
            + ", ".join(f"{f}={params.get(f)!r}" for f in _FLAGS)
        )
    return _prefill(params, draw) if is_prefill else _decode(params)


def _prefill(params: Mapping[str, Any], draw: Callable[[], str]) -> VllmPrefill:
    router_claim = params.get("transfer_id")
    if router_claim is not None:
        _check_claim("transfer_id", router_claim)
        if is_prefill_claim(router_claim):
            raise _invalid(
                f"transfer_id starts with {PREFILL_CLAIM_PREFIX!r}, which kvpush "
                "keeps for the claims prefill draws itself; a router's "
                "transfer_id must not (a uuid4 never does)"
            )
    claim = draw() if router_claim is None else router_claim
    leg = _convert(
        {"transfer_id": transfer_id_of(claim), "claim_sha256": claim_digest(claim)},
        PrefillLeg,
    )
    return VllmPrefill(leg, claim, router_claim is not None)


def _decode(params: Mapping[str, Any]) -> DecodeLeg:
    mode = params.get("transfer_mode")
    if mode is not None and mode != TRANSFER_MODE:
        raise _invalid(
            f"transfer_mode {mode!r}: these params come from a prefill that "
            f"does not push (kvpush's prefill answers {TRANSFER_MODE!r})"
        )
    is_router_set = params.get("transfer_id") is not None
    name = "transfer_id" if is_router_set else "remote_request_id"
    claim = params.get(name)
    if claim is None:
        raise _invalid(
            "a decode leg needs remote_request_id (from prefill's answer) or "
            "transfer_id (the one the router gave the prefill leg)"
        )
    _check_claim(name, claim)
    tp, port = _tp_size(params), _port(params)
    if port + tp - 1 > 65535:
        raise _invalid(f"remote_port {port} leaves no port for each of {tp} ranks")
    leg = {
        "transfer_id": transfer_id_of(claim),
        "prefill_engine_id": _text(params, "remote_engine_id", 256),
        "prefill_host": _text(params, "remote_host", 255),
        "prefill_port": port,
        "claim_token": claim,
        "prefill_tp": tp,
    }
    return _convert(leg, DecodeLeg)


def _check_claim(name: str, value: Any) -> None:
    if not isinstance(value, str) or not _CLAIM.match(value):
        # never the value of a string: it may be a real claim, mistyped
        shown = f"{len(value)} characters" if isinstance(value, str) else repr(value)
        raise _invalid(
            f"{name} ({shown}) is the transfer's claim: it must be 32 to 128 "
            "URL-safe characters (A-Z a-z 0-9 _ -), e.g. a uuid4 hex, so "
            "that it cannot be guessed"
        )


def _text(params: Mapping[str, Any], name: str, max_len: int) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not 1 <= len(value) <= max_len:
        raise _invalid(
            f"{name} must be a string of 1..{max_len} characters (prefill's "
            f"answer has it), not {value!r}"
        )
    return value


def _port(params: Mapping[str, Any]) -> int:
    value = params.get("remote_port")
    if value is None or not _is_int(value, 1, 65535):
        raise _invalid(f"remote_port must be a port number, not {value!r}")
    return int(value)


def _tp_size(params: Mapping[str, Any]) -> int:
    """Prefill's TP size (1 when the params leave it out or null)."""
    value = params.get("tp_size")
    if value is None:
        return 1
    if not _is_int(value, 1, MAX_TP_SIZE):
        raise _invalid(f"tp_size must be an integer in 1..{MAX_TP_SIZE}, not {value!r}")
    return int(value)


def _is_int(value: Any, low: int, high: int) -> bool:
    """``value`` is an integer (not a bool) in ``low..high``."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return is_int and low <= value <= high


def _convert(fields: dict[str, Any], kind: type[_L]) -> _L:
    try:
        return msgspec.convert(fields, kind)
    except msgspec.ValidationError as exc:
        raise _invalid(str(exc)) from None


def _invalid(problem: str) -> ValueError:
    return ValueError(f"invalid vLLM P/D kv_transfer_params: {problem}")
