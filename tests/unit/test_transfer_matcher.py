"""The matcher pairs a registration with ready KV in either order, keeps
deadlines on both, refuses duplicates and mismatches without surprises, and
hands every entry back exactly once: matched, dropped, or rejected."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.transfer.groups import of, one
from kvpush.transfer.matcher import (
    Dropped,
    Matched,
    Matcher,
    MatcherConfig,
    Pending,
    ReadyKv,
    Rejected,
)
from kvpush.transfer.messages import Registration

BS = 16
CONFIG = MatcherConfig(
    block_size=BS,
    ready_ttl_s=30.0,
    post_margin_s=1.0,
    tombstone_ttl_s=100.0,
    max_pending=8,
)


def reg(
    tid: str = "t1",
    dst: tuple[int, ...] = (10, 11, 12),
    num_tokens: int = 40,  # 3 blocks of 16
    first_block: int = 0,
    ttl_s: float = 10.0,
    engine: str = "d0",
) -> Registration:
    return Registration(tid, engine, "boot0", one(dst), num_tokens, ttl_s, first_block)


def ready(
    tid: str = "t1",
    src: tuple[int, ...] = (1, 2, 3),
    num_tokens: int = 40,
    engine: str = "d0",
) -> ReadyKv:
    return ReadyKv(tid, one(src), num_tokens, engine)


@pytest.fixture
def m() -> Matcher:
    return Matcher(CONFIG)


@pytest.mark.parametrize("registration_first", [True, False])
def test_either_order_pairs_the_blocks(m: Matcher, registration_first: bool) -> None:
    r, k = reg(), ready()
    first, second = (
        (lambda: m.add_registration(r, 100.0), lambda: m.add_ready(k, 105.0))
        if registration_first
        else (lambda: m.add_ready(k, 100.0), lambda: m.add_registration(r, 105.0))
    )
    assert isinstance(first(), Pending)
    assert m.is_pending("t1") and len(m) == 1
    result = second()
    assert isinstance(result, Matched)
    assert result.src_block_ids == one((1, 2, 3))
    assert result.dst_block_ids == one((10, 11, 12))
    assert (result.registration, result.ready) == (r, k)
    # Never post after decode's reservation ends: its arrival + ttl - margin.
    arrival = 100.0 if registration_first else 105.0
    assert result.post_deadline == arrival + 10.0 - 1.0
    assert len(m) == 0 and m.was_matched("t1") and m.next_deadline() is None


def test_prefix_hit_pairs_only_the_blocks_decode_lacks(m: Matcher) -> None:
    # 70 tokens are 5 blocks; decode holds blocks 0 and 1 in its prefix cache.
    m.add_ready(ready(src=(50, 51, 52, 53, 54), num_tokens=70), 0.0)
    result = m.add_registration(reg(dst=(7, 8, 9), num_tokens=70, first_block=2), 1.0)
    assert isinstance(result, Matched)
    assert result.src_block_ids == one((52, 53, 54))
    assert result.dst_block_ids == one((7, 8, 9))


def test_a_match_slices_every_group_from_first_block(m: Matcher) -> None:
    r = Registration(
        "t1", "d0", "boot0", of([[7, 8], [17, 18]]), 40, 10.0, first_block=1
    )
    m.add_registration(r, 0.0)
    result = m.add_ready(ReadyKv("t1", of([[1, 2, 3], [11, 12, 13]]), 40, "d0"), 1.0)
    assert isinstance(result, Matched)
    assert result.src_block_ids == of([[2, 3], [12, 13]])
    assert result.dst_block_ids == of([[7, 8], [17, 18]])


def test_extra_trailing_source_blocks_are_ignored(m: Matcher) -> None:
    m.add_registration(reg(), 0.0)
    result = m.add_ready(ready(src=(1, 2, 3, 4)), 1.0)
    assert isinstance(result, Matched) and result.src_block_ids == one((1, 2, 3))


@pytest.mark.parametrize("side", ["registration", "ready"])
def test_a_pending_duplicate_changes_nothing(m: Matcher, side: str) -> None:
    if side == "registration":
        m.add_registration(reg(dst=(10, 11, 12)), 0.0)
        dup = m.add_registration(reg(dst=(20, 21, 22)), 1.0)
    else:
        m.add_ready(ready(src=(1, 2, 3)), 0.0)
        dup = m.add_ready(ready(src=(4, 5, 6)), 1.0)
    assert isinstance(dup, Rejected) and dup.code == "duplicate"
    assert dup.dropped == ()
    result = (
        m.add_ready(ready(), 2.0)
        if side == "registration"
        else m.add_registration(reg(), 2.0)
    )
    assert isinstance(result, Matched)
    assert (result.src_block_ids, result.dst_block_ids) == (
        one((1, 2, 3)),
        one((10, 11, 12)),
    )


def test_a_duplicate_after_the_match_is_not_a_failure(m: Matcher) -> None:
    m.add_registration(reg(), 0.0)
    m.add_ready(ready(), 1.0)
    for late in (m.add_registration(reg(), 2.0), m.add_ready(ready(), 2.0)):
        assert isinstance(late, Rejected) and late.code == "duplicate"
    assert len(m) == 0


def test_registration_expires_and_decode_is_named(m: Matcher) -> None:
    m.add_registration(reg(ttl_s=10.0), 100.0)
    assert m.next_deadline() == 109.0
    assert m.expire(108.999) == []
    (dropped,) = m.expire(109.0)
    assert dropped.side == "registration" and "expired" in dropped.reason
    assert dropped.notify_engine_id == "d0" and dropped.ready is None
    late = m.add_ready(ready(), 110.0)
    assert isinstance(late, Rejected) and late.code == "closed"
    assert len(m) == 0


def test_ready_kv_expires_and_its_blocks_come_back(m: Matcher) -> None:
    m.add_ready(ready(src=(4, 5, 6)), 0.0)
    assert m.expire(29.9) == []
    (dropped,) = m.expire(30.0)
    assert dropped.side == "ready" and dropped.ready == ready(src=(4, 5, 6))
    assert dropped.notify_engine_id == "d0"
    late = m.add_registration(reg(), 31.0)
    assert isinstance(late, Rejected) and late.code == "closed"


def test_a_refreshed_ready_kv_lives_ready_ttl_from_its_last_refresh(
    m: Matcher,
) -> None:
    """A streamed prompt's later chunks restart its ready deadline: it waits
    ``ready_ttl_s`` from the last chunk, not from the first."""
    m.add_ready(ready(), 0.0)  # due 30
    assert m.refresh_ready("t1", 20.0) == 50.0
    assert m.next_deadline() == 50.0
    assert m.refresh_ready("t1", 45.0) == 75.0  # 45 s after the first chunk
    assert m.next_deadline() == 75.0
    assert m.expire(74.9) == [] and m.is_pending("t1")
    result = m.add_registration(reg(), 74.0)
    assert isinstance(result, Matched) and result.ready == ready()


def test_a_refreshed_ready_kv_expires_ready_ttl_after_its_last_refresh(
    m: Matcher,
) -> None:
    m.add_ready(ready(src=(4, 5, 6)), 0.0)
    m.refresh_ready("t1", 25.0)
    assert m.expire(54.9) == []
    (dropped,) = m.expire(55.0)
    assert dropped.side == "ready" and dropped.ready == ready(src=(4, 5, 6))
    assert m.next_deadline() is None and len(m) == 0


def test_refresh_changes_nothing_but_a_pending_ready_kv(m: Matcher) -> None:
    m.add_registration(reg("waiting", ttl_s=10.0), 0.0)  # due 9
    m.add_ready(ready("matched"), 0.0)
    m.add_registration(reg("matched"), 1.0)
    m.add_ready(ready("closed"), 0.0)
    m.cancel("closed", "gone", 1.0)
    m.add_ready(ready("overdue"), 0.0)  # due 30
    for tid in ("never-seen", "waiting", "matched", "closed"):
        assert m.refresh_ready(tid, 2.0) is None
    assert m.refresh_ready("overdue", 30.0) is None, "due: not revived"
    assert m.next_deadline() == 9.0
    assert [d.transfer_id for d in m.expire(30.0)] == ["waiting", "overdue"]
    assert m.was_matched("matched") and len(m) == 0
    late = m.add_registration(reg("closed"), 31.0)
    assert isinstance(late, Rejected) and late.code == "closed"


def test_an_overdue_entry_never_matches_even_before_expire(m: Matcher) -> None:
    m.add_registration(reg(ttl_s=10.0), 0.0)
    result = m.add_ready(ready(), 9.5)  # past 0 + 10 - margin 1
    assert isinstance(result, Rejected) and result.code == "closed"
    (dropped,) = result.dropped
    assert dropped.registration == reg(ttl_s=10.0)
    assert len(m) == 0


def test_expire_returns_earliest_first(m: Matcher) -> None:
    m.add_ready(ready("a"), 5.0)  # due 35
    m.add_registration(reg("b", ttl_s=20.0), 0.0)  # due 19
    m.add_ready(ready("c"), 1.0)  # due 31
    assert [d.transfer_id for d in m.expire(100.0)] == ["b", "c", "a"]


def test_cancel_drops_what_is_pending_and_refuses_what_comes_later(m: Matcher) -> None:
    m.add_ready(ready(src=(7, 8, 9)), 0.0)
    (dropped,) = m.cancel("t1", "client went away", 1.0)
    assert dropped.ready == ready(src=(7, 8, 9))
    assert "client went away" in dropped.reason
    late = m.add_registration(reg(), 2.0)
    assert isinstance(late, Rejected) and late.code == "closed"
    assert m.cancel("never-seen", "abort", 3.0) == ()
    assert isinstance(m.add_ready(ready("never-seen"), 4.0), Rejected)


def test_cancel_after_the_match_leaves_it_to_the_writer(m: Matcher) -> None:
    m.add_registration(reg(), 0.0)
    m.add_ready(ready(), 1.0)
    assert m.cancel("t1", "abort", 2.0) == ()
    assert m.was_matched("t1")


@pytest.mark.parametrize(
    ("registration", "kv", "needle"),
    [
        (reg(num_tokens=41), ready(num_tokens=40), "tokens"),  # 41 still 3 blocks
        (reg(engine="d9"), ready(), "'d9'"),
        # Decode's vLLM has one KV-cache group, prefill's two.
        (reg(), ReadyKv("t1", of([[1, 2, 3], [4, 5, 6]]), 40, "d0"), "1 KV-cache"),
    ],
)
@pytest.mark.parametrize("registration_first", [True, False])
def test_a_mismatch_closes_the_transfer(
    m: Matcher,
    registration: Registration,
    kv: ReadyKv,
    needle: str,
    registration_first: bool,
) -> None:
    if registration_first:
        m.add_registration(registration, 0.0)
        result = m.add_ready(kv, 1.0)
    else:
        m.add_ready(kv, 0.0)
        result = m.add_registration(registration, 1.0)
    assert isinstance(result, Rejected) and result.code == "mismatch"
    assert needle in result.reason
    (dropped,) = result.dropped  # the pending half is handed back
    assert dropped.side == ("registration" if registration_first else "ready")
    assert len(m) == 0


@pytest.mark.parametrize(
    "bad",
    [
        reg(dst=(1, 2, 3, 4)),  # 4 blocks for a 3-block prompt
        reg(dst=(1, 2)),  # too few
        reg(dst=(1, 2, 3), first_block=1),  # prefix skip overruns the prompt
        reg(ttl_s=0.5),  # shorter than the post margin
    ],
)
def test_an_inconsistent_registration_is_invalid(m: Matcher, bad: Registration) -> None:
    m.add_ready(ready(src=(4, 5, 6)), 0.0)
    result = m.add_registration(bad, 1.0)
    assert isinstance(result, Rejected) and result.code == "invalid"
    assert [d.ready for d in result.dropped] == [ready(src=(4, 5, 6))]
    assert len(m) == 0


@pytest.mark.parametrize(
    "bad",
    [
        ready(src=(1, 2)),
        ready(src=(1, 1, 2)),
        ready(num_tokens=0),
        ReadyKv("t1", of([[1, 2, 3], [4, 5]]), 40, "d0"),  # short in one group
        ReadyKv("t1", of([[1, 2, 3], [4, 5, 1]]), 40, "d0"),  # an id in two
        ReadyKv("t1", (), 40, "d0"),  # no group
    ],
)
def test_inconsistent_ready_kv_is_invalid(m: Matcher, bad: ReadyKv) -> None:
    result = m.add_ready(bad, 0.0)
    assert isinstance(result, Rejected) and result.code == "invalid"
    assert len(m) == 0


def test_pending_entries_are_capped(m: Matcher) -> None:
    for i in range(CONFIG.max_pending):
        assert isinstance(m.add_ready(ready(f"t{i}"), 0.0), Pending)
    full = m.add_registration(reg("one-more"), 0.0)
    assert isinstance(full, Rejected) and full.code == "capacity"
    assert isinstance(m.add_registration(reg("t0"), 0.0), Matched)  # pairs still do


def test_tombstones_are_forgotten_after_their_ttl(m: Matcher) -> None:
    m.add_registration(reg(), 0.0)
    m.add_ready(ready(), 1.0)
    m.expire(100.9)
    assert m.was_matched("t1")
    m.expire(101.0)
    assert not m.was_matched("t1")
    assert isinstance(m.add_registration(reg(), 102.0), Pending)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"block_size": 16, "ready_ttl_s": 0},
        {"block_size": 16, "post_margin_s": -1},
        {"block_size": 16, "max_pending": 0},
    ],
)
def test_config_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        MatcherConfig(**kwargs)  # type: ignore[arg-type]


# -- nothing leaks ----------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["reg", "ready", "cancel", "expire", "bad_reg", "refresh"]),
        st.sampled_from(["a", "b", "c"]),
        st.floats(0, 5),
    ),
    max_size=40,
)


@given(OPS)
def test_every_entry_comes_back_exactly_once(ops: list[tuple[str, str, float]]) -> None:
    """Whatever the interleaving, each accepted half leaves the matcher once,
    as part of a Matched or a Dropped; rejected halves never entered."""
    m = Matcher(CONFIG)
    now, accepted, returned = 0.0, [], []
    for op, tid, step in ops:
        now += step
        if op == "cancel":
            returned += _halves(m.cancel(tid, "test", now))
        elif op == "expire":
            returned += _halves(m.expire(now))
        elif op == "refresh":
            m.refresh_ready(tid, now)
        else:
            item = {
                "reg": reg(tid),
                "bad_reg": reg(tid, dst=(1,)),
                "ready": ready(tid),
            }[op]
            result = (
                m.add_ready(item, now)
                if isinstance(item, ReadyKv)
                else m.add_registration(item, now)
            )
            if isinstance(result, Pending):
                accepted.append(item)
            elif isinstance(result, Matched):
                accepted.append(item)
                returned += [result.registration, result.ready]
            else:
                returned += _halves(result.dropped)
    returned += _halves(m.expire(now + 1e6))
    assert len(m) == 0 and m.next_deadline() is None
    assert sorted(map(repr, returned)) == sorted(map(repr, accepted))


def _halves(dropped: tuple[Dropped, ...] | list[Dropped]) -> list[object]:
    return [d.registration or d.ready for d in dropped]


# -- deadlines at scale: a wake costs what is due -----------------------------


def test_many_entries_expire_in_deadline_order() -> None:
    m = Matcher(MatcherConfig(block_size=BS, max_pending=5000))

    def arrival(i: int) -> float:  # 2000 distinct times in 0..19.99, shuffled
        return (i * 7919 % 2000) / 100

    for i in range(2000):  # each due at arrival + ttl 10 - margin 1
        m.add_registration(reg(f"r{i}", ttl_s=10.0), arrival(i))
    assert m.next_deadline() == 9.0
    by_arrival = sorted(range(2000), key=arrival)
    first = m.expire(9.5)  # arrivals 0.00 .. 0.50
    assert [d.transfer_id for d in first] == [f"r{i}" for i in by_arrival[:51]]
    assert m.next_deadline() == arrival(by_arrival[51]) + 9.0
    rest = m.expire(1e9)
    assert [d.transfer_id for d in rest] == [f"r{i}" for i in by_arrival[51:]]
    assert m.next_deadline() is None and len(m) == 0


def test_cancelled_and_matched_entries_leave_the_deadlines() -> None:
    m = Matcher(CONFIG)
    m.add_registration(reg("early", ttl_s=5.0), 0.0)  # due 4
    m.add_ready(ready("matched"), 0.0)  # due 30
    m.add_ready(ready("late"), 10.0)  # due 40
    m.cancel("early", "gone", 1.0)
    assert m.next_deadline() == 30.0
    assert isinstance(m.add_registration(reg("matched"), 2.0), Matched)
    assert m.next_deadline() == 40.0
    assert m.expire(35.0) == []
    assert [d.transfer_id for d in m.expire(40.0)] == ["late"]


def test_a_repeated_cancel_keeps_the_transfer_closed_for_a_full_ttl() -> None:
    m = Matcher(CONFIG)
    m.cancel("t1", "first", 0.0)  # tombstone until 100
    m.cancel("t1", "again", 50.0)  # renewed: until 150
    m.expire(120.0)
    assert isinstance(m.add_registration(reg(), 121.0), Rejected)
    m.expire(150.0)
    assert isinstance(m.add_registration(reg(), 151.0), Pending)


def test_engines_with_registrations_follow_every_exit() -> None:
    m = Matcher(MatcherConfig(block_size=BS, max_pending=8))
    m.add_registration(reg("a", engine="d0"), 0.0)
    m.add_registration(reg("b", engine="d0"), 0.0)
    m.add_registration(reg("c", engine="d1", ttl_s=5.0), 0.0)
    m.add_ready(ready("x", engine="d2"), 0.0)  # ready KV names no registration
    assert m.engines_with_registrations() == {"d0", "d1"}
    assert isinstance(m.add_ready(ready("a"), 1.0), Matched)
    assert m.engines_with_registrations() == {"d0", "d1"}
    m.cancel("b", "gone", 1.0)
    assert m.engines_with_registrations() == {"d1"}
    m.expire(4.0)
    assert m.engines_with_registrations() == set()
    returned = m.engines_with_registrations()
    returned.add("mine")  # the caller's own set
    assert m.engines_with_registrations() == set()


@given(OPS)
def test_next_deadline_and_engines_match_a_full_scan(
    ops: list[tuple[str, str, float]],
) -> None:
    m = Matcher(CONFIG)
    now, pending = 0.0, {}  # (side, tid) -> deadline, from the results
    for op, tid, step in ops:
        now += step
        if op == "cancel":
            gone = m.cancel(tid, "test", now)
        elif op == "expire":
            gone = tuple(m.expire(now))
        elif op == "refresh":
            gone, was = (), pending.get(("ready", tid))
            deadline = m.refresh_ready(tid, now)
            if was is None or was <= now:
                assert deadline is None
            else:
                assert deadline == now + CONFIG.ready_ttl_s
                pending[("ready", tid)] = deadline
        else:
            item = {"reg": reg(tid), "bad_reg": reg(tid, dst=(1,)), "ready": ready(tid)}
            half = item[op]
            result = (
                m.add_ready(half, now)
                if isinstance(half, ReadyKv)
                else m.add_registration(half, now)
            )
            gone = result.dropped if isinstance(result, Rejected) else ()
            if isinstance(result, Pending):
                pending[(result.side, tid)] = result.deadline
            elif isinstance(result, Matched):
                pending.pop(("registration", tid), None)
                pending.pop(("ready", tid), None)
        for d in gone:
            del pending[(d.side, d.transfer_id)]
        assert m.next_deadline() == min(pending.values(), default=None)
        engines = {"d0" for side, _ in pending if side == "registration"}
        assert m.engines_with_registrations() == engines
