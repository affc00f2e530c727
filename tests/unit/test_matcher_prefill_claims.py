"""Claims prefill drew itself, in the matcher: a registration bearing one
is refused at once, holding nothing, unless its ready KV is here.

Such a claim (it starts with ``PREFILL_CLAIM_PREFIX``) reaches a decode
only after prefill's matcher took its ready KV, so a registration that
brings one first is forged, another prefill's, or long over. A claim of
any other form may be a router's, sent to decode with the prefill leg:
its registration may come first, and waits. The general claim rule
(who may claim, once) is ``test_transfer_claims.py``'s.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.transfer.groups import one
from kvpush.transfer.matcher import (
    PREFILL_CLAIM_PREFIX,
    Matched,
    Matcher,
    MatcherConfig,
    Pending,
    ReadyKv,
    Rejected,
    is_prefill_claim,
)
from kvpush.transfer.messages import Registration, claim_digest
from tests.fakes.fake_nixl import leftovers

CONFIG = MatcherConfig(block_size=16, ready_ttl_s=30.0, tombstone_ttl_s=100.0)
DRAWN = PREFILL_CLAIM_PREFIX + "c" * 43  # a claim prefill drew
ROUTERS = uuid.uuid4().hex  # a router's transfer_id, as a claim


def reg(
    token: str | None = DRAWN,
    engine: str = "d1",
    tid: str = "t1",
    dst: tuple[int, ...] = (10, 11, 12),
) -> Registration:
    return Registration(tid, engine, "boot0", one(dst), 40, 10.0, claim_token=token)


def late(token: str = DRAWN, tid: str = "t1") -> ReadyKv:
    return ReadyKv(tid, one((1, 2, 3)), 40, None, claim_sha256=claim_digest(token))


@pytest.fixture
def m() -> Matcher:
    return Matcher(CONFIG)


def test_only_the_prefix_makes_a_prefill_drawn_claim() -> None:
    assert is_prefill_claim(DRAWN)
    assert not is_prefill_claim(ROUTERS) and not is_prefill_claim(None)
    assert not is_prefill_claim(str(uuid.uuid4()))


@pytest.mark.parametrize("dst", [(10, 11, 12), (10,)], ids=["valid", "invalid"])
def test_a_prefill_drawn_claim_with_no_kv_here_is_refused_holding_nothing(
    m: Matcher, dst: tuple[int, ...]
) -> None:
    result = m.add_registration(reg(dst=dst), 0.0)

    assert isinstance(result, Rejected) and result.code == "unknown_claim"
    assert result.dropped == () and DRAWN not in result.reason
    assert len(m) == 0 and m.next_deadline() is None
    assert m.engines_with_registrations() == set()
    assert leftovers(m) == {}, "not even a tombstone"


def test_a_prefill_drawn_claim_claims_the_kv_it_was_drawn_for(m: Matcher) -> None:
    assert isinstance(m.add_ready(late(), 0.0), Pending)
    assert isinstance(m.add_registration(reg(), 1.0), Matched)


def test_a_routers_claim_may_come_before_its_kv_and_waits(m: Matcher) -> None:
    assert isinstance(m.add_registration(reg(ROUTERS), 0.0), Pending)
    assert isinstance(m.add_ready(late(ROUTERS), 1.0), Matched)


def test_a_replayed_prefill_drawn_claim_is_refused_then_unknown(m: Matcher) -> None:
    m.add_ready(late(), 0.0)
    m.add_registration(reg(engine="d1"), 0.0)

    same, other = reg(engine="d1"), reg(engine="d0")
    assert _code(m.add_registration(same, 1.0)) == "duplicate"
    assert _code(m.add_registration(other, 1.0)) == "claimed"
    m.expire(100.0)  # the tombstone is forgotten
    assert _code(m.add_registration(other, 101.0)) == "unknown_claim"
    assert leftovers(m) == {}


def test_a_prefill_drawn_claim_after_its_kv_expired_is_refused(m: Matcher) -> None:
    m.add_ready(late(), 0.0)
    assert [d.transfer_id for d in m.expire(30.0)] == ["t1"]

    assert _code(m.add_registration(reg(), 31.0)) == "closed"
    m.expire(130.0)
    assert _code(m.add_registration(reg(), 131.0)) == "unknown_claim"


def _code(result: object) -> str:
    assert isinstance(result, Rejected), result
    return result.code


OPS = st.lists(
    st.tuples(
        st.sampled_from(["ready", "drawn", "routers", "cancel", "expire"]),
        st.sampled_from(["a", "b"]),
        st.sampled_from(["d0", "d1"]),
        st.floats(0, 60),
    ),
    max_size=30,
)


@given(OPS)
def test_a_prefill_drawn_claim_never_waits_in_the_matcher(
    ops: list[tuple[str, str, str, float]],
) -> None:
    """Whatever the interleaving, a registration bearing a prefill-drawn
    claim is matched or refused at once, never held; a router's may wait."""
    m, now = Matcher(CONFIG), 0.0
    for op, tid, engine, step in ops:
        now += step
        if op == "cancel":
            m.cancel(tid, "test", now)
        elif op == "expire":
            m.expire(now)
        elif op == "ready":
            m.add_ready(late(tid=tid), now)
        else:
            token = DRAWN if op == "drawn" else ROUTERS
            result = m.add_registration(reg(token, engine, tid), now)
            assert op == "routers" or not isinstance(result, Pending)
        held = m.registrations_of("d0") + m.registrations_of("d1")
        assert DRAWN not in {r.claim_token for r in held}
