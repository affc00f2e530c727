"""Late binding in prefill's writer: a ready KV whose leg named no decode,
only the SHA-256 of a claim token, is written at once to whichever decode
registers with that token, once.

Real writer thread over :class:`FakeNixlIO` (the ``Rig`` of
``test_connector_writer.py``) with two decodes, ``d0`` and ``d1``, both said
Hello; prompt 60 tokens in 16-token blocks (4 blocks), prefill's blocks 4, 5,
6, 9, decode's 10..13.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from kvpush.connector.prefill.fence import NoFence
from kvpush.transfer.matcher import ReadyKv
from kvpush.transfer.messages import (
    Cancel,
    Cause,
    Done,
    Failure,
    Hello,
    HelloReply,
    Reconcile,
    Registration,
    claim_digest,
)
from tests.fakes.fake_nixl import FakeNixlIO, wait_for
from tests.unit.test_connector_writer import (
    BOOT,
    DECODE,
    DECODE_ROUTE,
    DST_BASE,
    PREFILL,
    Rig,
    layout,
)
from tests.unit.test_connector_writer_stream import blocks_of

TOKEN = secrets.token_urlsafe(32)
D1, D1_ROUTE = "d1", b"route-d1"
SLOW = ("PROC",) * 200 + ("DONE",)  # a WRITE that runs for ~0.1 s


class LateRig(Rig):
    """The writer's rig with a second decode, ``d1``, linked and greeted."""

    def __init__(self, ready_ttl_s: float = 30.0) -> None:
        super().__init__(ready_ttl_s=ready_ttl_s)
        self.d1_io = FakeNixlIO("kvpush-d1", layout(DST_BASE))
        self.io.link(self.d1_io)
        self.hello()
        io = self.d1_io
        self.writer.on_message(
            D1_ROUTE, Hello(D1, BOOT, io.name, io.metadata, io.layout)
        )
        assert wait_for(lambda: self.replies_to(D1_ROUTE, HelloReply))

    def late_ready(
        self, src: tuple[int, ...] = (4, 5, 6, 9), first: int = 0, final: bool = True
    ) -> None:
        kv = ReadyKv(
            "t1", src, 60, None, first_block=first, final=final,
            claim_sha256=claim_digest(TOKEN),
        )  # fmt: skip
        self.writer.kv_ready(kv, "req-1", NoFence())

    def claim(
        self,
        engine: str = D1,
        token: str | None = TOKEN,
        route: bytes = D1_ROUTE,
    ) -> None:
        reg = Registration(
            transfer_id="t1",
            decode_engine_id=engine,
            decode_boot_id=BOOT,
            dst_block_ids=(10, 11, 12, 13),
            num_tokens=60,
            ttl_s=10.0,
            claim_token=token,
        )
        self.writer.on_message(route, reg)

    def failures_to(self, route: bytes) -> list[Failure]:
        return self.replies_to(route, Failure)  # type: ignore[return-value]


@pytest.fixture
def rig() -> Iterator[LateRig]:
    r = LateRig()
    yield r
    r.close()


def test_the_right_token_from_any_decode_writes_the_ready_kv_at_once(rig: LateRig):
    rig.late_ready()
    rig.sync()
    assert rig.io.writes_snapshot() == [], "nobody claimed it yet"

    rig.claim(D1)

    assert rig.wait_finished("req-1")
    (write,) = rig.io.writes_snapshot()
    assert write.peer == "kvpush-d1"
    assert write.message == Done("t1", PREFILL, num_blocks=4)
    assert rig.d1_io.notifications() == [write.notif]
    assert rig.decode_io.notifications() == [], "d0 was not written to"
    assert rig.replies.of(Failure) == []


@pytest.mark.parametrize("token", [secrets.token_urlsafe(32), None])
def test_a_wrong_or_missing_token_frees_the_kv_and_tells_that_decode(
    rig: LateRig, token: str | None
):
    rig.late_ready()
    rig.claim(D1, token=token)

    assert rig.wait_finished("req-1")
    assert wait_for(lambda: rig.failures_to(D1_ROUTE))
    (failure,) = rig.failures_to(D1_ROUTE)
    assert failure.cause is Cause.REJECTED
    assert TOKEN not in failure.detail and (token or TOKEN) not in failure.detail
    assert rig.io.writes_snapshot() == []
    assert rig.counters.get("rejected.mismatch") == 1

    rig.claim(D1)  # the right token, too late: the transfer is closed
    assert wait_for(lambda: len(rig.failures_to(D1_ROUTE)) == 2)
    assert rig.io.writes_snapshot() == []


def test_a_claim_token_for_an_early_leg_is_a_mismatch(rig: LateRig):
    rig.ready()  # early: names d0
    rig.claim(DECODE, token=TOKEN, route=DECODE_ROUTE)

    assert rig.wait_finished("req-1")
    assert wait_for(lambda: rig.failures_to(DECODE_ROUTE))
    assert {f.cause for f in rig.failures_to(DECODE_ROUTE)} == {Cause.REJECTED}
    assert rig.io.writes_snapshot() == []


def test_claimed_once_the_second_decode_is_told_and_the_first_write_goes_on(
    rig: LateRig,
):
    rig.io.script_polls(*SLOW)
    rig.late_ready()
    rig.claim(D1)
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 1)

    rig.claim(DECODE, route=DECODE_ROUTE)  # d0 holds the token too
    rig.writer.on_message(DECODE_ROUTE, Cancel("t1", DECODE, "gave up"))
    rig.writer.on_message(DECODE_ROUTE, Reconcile(DECODE, BOOT, ("t1",)))

    assert wait_for(lambda: len(rig.failures_to(DECODE_ROUTE)) == 3)
    assert [f.cause for f in rig.failures_to(DECODE_ROUTE)] == [
        Cause.REJECTED,
        Cause.CANCELLED,
        Cause.REJECTED,
    ]
    assert rig.counters.get("rejected.claimed") == 1
    assert rig.wait_finished("req-1")
    (write,) = rig.io.writes_snapshot()
    assert write.peer == "kvpush-d1" and write.done
    assert rig.d1_io.notifications() == [write.notif], "d1's WRITE unaffected"
    assert rig.failures_to(D1_ROUTE) == []
    # once it is over, another claim is still told, and d1's final word is
    # still its Done (a Reconcile from d1 gets it again)
    rig.claim(DECODE, route=DECODE_ROUTE)
    assert wait_for(lambda: len(rig.failures_to(DECODE_ROUTE)) == 4)
    rig.writer.on_message(D1_ROUTE, Reconcile(D1, BOOT, ("t1",)))
    assert wait_for(lambda: rig.replies_to(D1_ROUTE, Done))
    assert rig.failures_to(D1_ROUTE) == []


def test_an_unclaimed_late_ready_kv_expires_and_frees_its_blocks():
    rig = LateRig(ready_ttl_s=0.05)
    try:
        rig.late_ready()

        assert rig.wait_finished("req-1")
        assert rig.counters.get("expired.ready") == 1
        rig.sync()
        assert rig.replies.of(Failure) == [], "nobody to tell"
        assert rig.counters.get("failed.unroutable") == 0
        assert rig.io.writes_snapshot() == []
    finally:
        rig.close()


def test_late_chunks_ready_before_the_claim_catch_up_in_one_write(rig: LateRig):
    rig.late_ready((4, 5), first=0, final=False)
    rig.late_ready((6, 9), first=2, final=True)
    rig.sync()
    assert rig.io.writes_snapshot() == []

    rig.claim(D1)

    assert rig.wait_finished("req-1")
    (write,) = rig.io.writes_snapshot()
    assert blocks_of(write) == ([4, 5, 6, 9], [10, 11, 12, 13])
    assert write.peer == "kvpush-d1"
    assert write.message == Done("t1", PREFILL, num_blocks=4)


def test_a_late_stream_claimed_mid_way_pushes_the_rest_as_it_comes(rig: LateRig):
    rig.late_ready((4, 5), first=0, final=False)
    rig.claim(D1)
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 1)
    stream = rig.writer._pipeline._streams.get("t1")
    assert stream is not None and stream.engine == D1, "learnt at the match"
    rig.late_ready((6, 9), first=2, final=True)

    assert rig.wait_finished("req-1")
    writes = rig.io.writes_snapshot()
    assert [blocks_of(w) for w in writes] == [([4, 5], [10, 11]), ([6, 9], [12, 13])]
    assert all(w.peer == "kvpush-d1" for w in writes)
    assert rig.d1_io.notifications() == [writes[-1].notif]
