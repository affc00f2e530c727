"""Late binding in prefill's writer: a ready KV whose leg named no decode,
only the SHA-256 of a claim token, is written at once to whichever decode
registers with that token, once. The rules are tested on the pure
pipeline (``test_prefill_pipeline_stream.py``); here, with the real writer
thread, a second decode's claim, Cancel and Reconcile while the first
decode's WRITE runs.

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
from kvpush.transfer.groups import one
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
from tests.unit.prefill_pipeline_rig import FOREVER
from tests.unit.test_connector_writer import (
    BOOT,
    DECODE,
    DECODE_ROUTE,
    DST_BASE,
    Rig,
    layout,
)
from tests.unit.test_connector_writer_safety import end_write

TOKEN = secrets.token_urlsafe(32)
D1, D1_ROUTE = "d1", b"route-d1"


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
            "t1", one(src), 60, None, first_block=first, final=final,
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
            dst_block_ids=one((10, 11, 12, 13)),
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


def test_claimed_once_the_second_decode_is_told_and_the_first_write_goes_on(
    rig: LateRig,
):
    rig.io.script_polls(*FOREVER)  # ends when the test says so
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
    end_write(rig, rig.io.writes_snapshot()[0])
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
