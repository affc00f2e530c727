"""Late binding on the wire and in the matcher: which decode may claim a
prefill's ready KV.

A leg names exactly one of ``decode_engine_id`` (early) and ``claim_sha256``
(late). An early ready KV matches only its named decode, with no token; a
late one matches any decode whose registration carries the token hashing to
the digest; anything else closes the transfer (``mismatch``). A transfer is
claimed once: the engine that matched it repeating itself is a
``duplicate``, any other engine is ``claimed`` (told).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import pytest

from kvpush.transfer.groups import one
from kvpush.transfer.matcher import (
    Dropped,
    Matched,
    Matcher,
    MatcherConfig,
    Pending,
    ReadyKv,
    Rejected,
)
from kvpush.transfer.messages import (
    PROTOCOL_VERSION,
    DecodeLeg,
    PrefillLeg,
    Registration,
    TransferParams,
    claim_digest,
    decode,
    encode,
)

BS = 16
CONFIG = MatcherConfig(block_size=BS, ready_ttl_s=30.0, tombstone_ttl_s=100.0)
TOKEN = secrets.token_urlsafe(32)
DIGEST = hashlib.sha256(TOKEN.encode()).hexdigest()
OTHER_TOKEN = secrets.token_urlsafe(32)


def reg(engine: str = "d1", token: str | None = TOKEN, tid: str = "t1") -> Registration:
    dst = one((10, 11, 12))
    return Registration(tid, engine, "boot0", dst, 40, 10.0, claim_token=token)


def late(tid: str = "t1", digest: str = DIGEST) -> ReadyKv:
    return ReadyKv(tid, one((1, 2, 3)), 40, None, claim_sha256=digest)


def early(engine: str = "d0") -> ReadyKv:
    return ReadyKv("t1", one((1, 2, 3)), 40, engine)


@pytest.fixture
def m() -> Matcher:
    return Matcher(CONFIG)


# -- the wire ------------------------------------------------------------------


def test_claim_digest_is_the_hex_sha256_the_router_computes() -> None:
    assert claim_digest(TOKEN) == DIGEST
    assert PROTOCOL_VERSION >= 5  # late binding came with protocol 5


@pytest.mark.parametrize(
    "d",
    [
        {"role": "prefill", "transfer_id": "kvp-1", "decode_engine_id": "d0"},
        {"role": "prefill", "transfer_id": "kvp-1", "claim_sha256": DIGEST},
        {
            "role": "decode",
            "transfer_id": "kvp-1",
            "prefill_engine_id": "prefill0",
            "prefill_host": "127.0.0.1",
            "prefill_port": 5600,
            "claim_token": TOKEN,
        },
    ],
)
def test_legs_round_trip_and_leave_unset_fields_out(d: dict[str, Any]) -> None:
    leg = TransferParams.from_dict(d)
    assert leg.to_dict() == d
    assert TransferParams.from_dict(leg.to_dict()) == leg


def test_a_late_prefill_leg_names_no_decode() -> None:
    leg = TransferParams.from_dict(
        {"role": "prefill", "transfer_id": "t", "claim_sha256": DIGEST}
    )
    assert isinstance(leg, PrefillLeg)
    assert leg.is_late and leg.decode_engine_id is None
    assert not PrefillLeg(transfer_id="t", decode_engine_id="d0").is_late


@pytest.mark.parametrize(
    ("extra", "hint"),
    [
        ({}, "exactly one of decode_engine_id"),
        ({"decode_engine_id": "d0", "claim_sha256": DIGEST}, "exactly one of"),
        ({"claim_sha256": DIGEST.upper()}, "claim_sha256"),
        ({"claim_sha256": DIGEST[:-1]}, "claim_sha256"),
        ({"claim_sha256": TOKEN}, "claim_sha256"),
    ],
)
def test_a_prefill_leg_with_both_or_neither_or_bad_hex_is_refused(
    extra: dict[str, Any], hint: str
) -> None:
    with pytest.raises(ValueError, match=hint) as info:
        TransferParams.from_dict({"role": "prefill", "transfer_id": "t", **extra})
    assert "claim_sha256 (late binding" in str(info.value), "says what to send"


@pytest.mark.parametrize(
    "token", ["short", "x" * 129, "has space" + "x" * 30, "a+b/" * 10, ""]
)
def test_a_bad_claim_token_is_refused_on_the_leg_and_the_wire(token: str) -> None:
    with pytest.raises(ValueError, match="claim_token"):
        TransferParams.from_dict(
            {
                "role": "decode",
                "transfer_id": "t",
                "prefill_engine_id": "p0",
                "prefill_host": "h",
                "prefill_port": 1,
                "claim_token": token,
            }
        )
    with pytest.raises(Exception, match="claim_token"):
        encode(reg(token=token))


def test_a_registration_carries_its_claim_token() -> None:
    r = reg()
    assert decode(encode(r)) == r
    assert decode(encode(reg(token=None))).claim_token is None  # type: ignore[union-attr]


# -- the matcher's claim rule ----------------------------------------------------


@pytest.mark.parametrize("engine", ["d0", "d1", "any-decode"])
def test_a_late_ready_kv_matches_the_right_token_from_any_decode(
    m: Matcher, engine: str
) -> None:
    assert isinstance(m.add_ready(late(), 0.0), Pending)
    result = m.add_registration(reg(engine), 1.0)
    assert isinstance(result, Matched)
    assert (result.src_block_ids, result.dst_block_ids) == (
        one((1, 2, 3)),
        one((10, 11, 12)),
    )
    assert m.registered_by("t1") == engine
    assert len(m) == 0


def test_registration_before_a_late_ready_kv_also_matches(m: Matcher) -> None:
    assert isinstance(m.add_registration(reg(), 0.0), Pending)
    assert isinstance(m.add_ready(late(), 1.0), Matched)


@pytest.mark.parametrize("token", [OTHER_TOKEN, None], ids=["wrong", "missing"])
def test_a_wrong_or_missing_token_closes_a_late_transfer(
    m: Matcher, token: str | None
) -> None:
    m.add_ready(late(), 0.0)
    result = m.add_registration(reg(token=token), 1.0)
    assert isinstance(result, Rejected) and result.code == "mismatch"
    assert all(t not in result.reason for t in (TOKEN, OTHER_TOKEN)), "no token"
    (dropped,) = result.dropped
    assert dropped.ready == late() and dropped.notify_engine_id == ""
    # closed: the right token cannot claim it afterwards
    again = m.add_registration(reg(), 2.0)
    assert isinstance(again, Rejected) and again.code == "closed"
    assert len(m) == 0


def test_a_claim_token_for_an_early_transfer_is_a_mismatch(m: Matcher) -> None:
    m.add_ready(early("d1"), 0.0)
    result = m.add_registration(reg("d1", token=TOKEN), 1.0)
    assert isinstance(result, Rejected) and result.code == "mismatch"
    assert "bound early" in result.reason
    assert [d.notify_engine_id for d in result.dropped] == ["d1"]


def test_an_early_ready_kv_still_matches_only_its_named_decode(m: Matcher) -> None:
    m.add_ready(early("d0"), 0.0)
    result = m.add_registration(reg("d1", token=None), 1.0)
    assert isinstance(result, Rejected) and result.code == "mismatch"
    m2 = Matcher(CONFIG)
    m2.add_ready(early("d0"), 0.0)
    assert isinstance(m2.add_registration(reg("d0", token=None), 1.0), Matched)


def test_a_late_transfer_is_claimed_once(m: Matcher) -> None:
    m.add_ready(late(), 0.0)
    assert isinstance(m.add_registration(reg("d1"), 1.0), Matched)

    same = m.add_registration(reg("d1"), 2.0)
    other = m.add_registration(reg("d2"), 2.0)

    assert isinstance(same, Rejected) and same.code == "duplicate"
    assert isinstance(other, Rejected) and other.code == "claimed"
    assert other.dropped == () and m.registered_by("t1") == "d1"
    assert m.was_matched("t1"), "the first claim stands"


def test_a_second_decode_while_a_registration_is_pending_is_told(m: Matcher) -> None:
    m.add_registration(reg("d1"), 0.0)
    result = m.add_registration(reg("d2"), 1.0)
    assert isinstance(result, Rejected) and result.code == "claimed"
    assert isinstance(m.add_ready(late(), 2.0), Matched)
    assert m.registered_by("t1") == "d1"


def test_the_claim_is_remembered_for_the_tombstone_time(m: Matcher) -> None:
    m.add_ready(late(), 0.0)
    m.add_registration(reg("d1"), 1.0)
    m.expire(1.0 + CONFIG.tombstone_ttl_s)
    assert m.registered_by("t1") is None and not m.was_matched("t1")


def test_an_unclaimed_late_ready_kv_expires_at_the_ready_deadline(m: Matcher) -> None:
    m.add_ready(late(), 0.0)
    assert m.ids_for_engine("d1") == [], "a late ready KV is no decode's"
    assert m.expire(CONFIG.ready_ttl_s - 0.1) == []
    (dropped,) = m.expire(CONFIG.ready_ttl_s)
    assert isinstance(dropped, Dropped) and dropped.side == "ready"
    assert dropped.notify_engine_id == "", "nobody to tell"
    assert len(m) == 0


@pytest.mark.parametrize(
    "ready",
    [
        ReadyKv("t1", one((1, 2, 3)), 40, None),
        ReadyKv("t1", one((1, 2, 3)), 40, "d0", claim_sha256=DIGEST),
    ],
)
def test_a_ready_kv_names_a_decode_or_a_digest_not_both(
    m: Matcher, ready: ReadyKv
) -> None:
    result = m.add_ready(ready, 0.0)
    assert isinstance(result, Rejected) and result.code == "invalid"


def test_the_router_side_legs_build_from_a_fresh_token() -> None:
    token = secrets.token_urlsafe(32)
    p = PrefillLeg(transfer_id="t", claim_sha256=claim_digest(token))
    d = DecodeLeg(
        transfer_id="t",
        prefill_engine_id="p0",
        prefill_host="h",
        prefill_port=1,
        claim_token=token,
    )
    assert TransferParams.from_dict(p.to_dict()) == p
    assert TransferParams.from_dict(d.to_dict()) == d
