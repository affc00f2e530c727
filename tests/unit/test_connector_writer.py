"""The prefill writer pushes a prompt's KV into decode's blocks exactly once,
whatever the order in which the decode's Hello, its Registration and the
prompt's finished KV arrive, and frees prefill's blocks (``take_finished``)
however the push ends: written, failed, expired or cancelled.

Each test runs a real writer thread over :class:`FakeNixlIO`; a recording
``reply`` stands in for the side-channel listener.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.connector.counters import Counters
from kvpush.connector.faults import FaultSource
from kvpush.connector.prefill.fence import NoFence
from kvpush.connector.prefill.pipeline import WriterConfig
from kvpush.connector.prefill.writer import Writer
from kvpush.connector.trace import Tracer
from kvpush.transfer.coalesce import Desc
from kvpush.transfer.digest import VERIFY_OFF, VerifyPolicy
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.matcher import MatcherConfig, ReadyKv
from kvpush.transfer.messages import (
    Cancel,
    Cause,
    Done,
    Failure,
    Heartbeat,
    Hello,
    HelloReply,
    Message,
    Reconcile,
    Registration,
)
from tests.fakes.fake_nixl import FakeMemory, FakeNixlIO, leftovers, wait_for

BS = 16  # tokens per block
NUM_LAYERS = 2
NUM_BLOCKS = 32
BLOCK_BYTES = 256
SRC_BASE = 0x100000
DST_BASE = 0x900000
LAYER_BYTES = NUM_BLOCKS * BLOCK_BYTES
WAIT_S = 2.0

PREFILL = "p0"
DECODE = "d0"
DECODE_ROUTE = b"route-d0"
BOOT = "boot-1"


def layout(
    base: int, block_bytes: int = BLOCK_BYTES, num_layers: int = NUM_LAYERS
) -> KvLayout:
    return KvLayout.contiguous_layers(
        base, num_layers, NUM_BLOCKS, block_bytes, BS, kv_dtype="float32"
    )


class Replies:
    """The writer's ``reply`` callable, recording (route, message)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent: list[tuple[bytes, Message]] = []

    def __call__(self, route: bytes, message: Message) -> None:
        with self._lock:
            self.sent.append((route, message))

    def of(self, kind: type) -> list[tuple[bytes, Message]]:
        with self._lock:
            return [(r, m) for r, m in self.sent if isinstance(m, kind)]


class Rig:
    """A writer with a fake prefill agent linked to a fake decode agent."""

    def __init__(
        self,
        tmp_trace_dir: str = "",
        ready_ttl_s: float = 30.0,
        peer_timeout_s: float = 10.0,
        fault_file: str = "",
        num_layers: int = NUM_LAYERS,
        rank: int = 0,
        tp_size: int = 1,
        decode_ios: list[FakeNixlIO] | None = None,
        total_kv_heads: int = 0,
        block_bytes: int = BLOCK_BYTES,
        verify: VerifyPolicy = VERIFY_OFF,
    ) -> None:
        """Prefill worker rank ``rank`` of ``tp_size`` (a block of
        ``block_bytes``); its decode peer is the decode rank it writes to
        (same TP size), or with ``decode_ios`` each decode rank's agent
        (decode TP ``len(decode_ios)``, the model's ``total_kv_heads``).
        ``memory`` holds its KV bytes (what ``verify``'s digests hash)."""
        self.rank, self.tp_size = rank, tp_size
        self.decode_tp = len(decode_ios) if decode_ios else tp_size
        self.io = FakeNixlIO(
            f"kvpush-p0-rank{rank}" if decode_ios else "kvpush-p0",
            layout(SRC_BASE, block_bytes, num_layers=num_layers),
        )
        self.decode_ios = decode_ios or [
            FakeNixlIO("kvpush-d0", layout(DST_BASE, num_layers=num_layers))
        ]
        self.decode_io = self.decode_ios[0]
        self.memory = FakeMemory(self.io.layout)
        for decode_io in self.decode_ios:
            self.io.link(decode_io)
        self.replies = Replies()
        self.tracer = Tracer(tmp_trace_dir, PREFILL)
        config = MatcherConfig(block_size=BS, ready_ttl_s=ready_ttl_s)
        self.counters = Counters()
        self.writer = Writer(
            self.io,
            WriterConfig(
                PREFILL,
                config,
                peer_timeout_s=peer_timeout_s,
                tp_size=tp_size,
                rank=rank,
                total_kv_heads=total_kv_heads,
                verify=verify,
            ),
            self.replies,
            self.tracer,
            self.counters,
            FaultSource(fault_file),
            self.memory,
        )
        self.finished: set[str] = set()
        self._probes = 0

    # -- inputs ----------------------------------------------------------------

    def hello(
        self,
        engine: str = DECODE,
        route: bytes = DECODE_ROUTE,
        decode_layout: KvLayout | None = None,
        boot_id: str = BOOT,
        rank: int | None = None,
        tp_size: int | None = None,
        total_kv_heads: int | None = None,
    ) -> None:
        """Decode ``engine``'s Hello, from decode rank ``rank`` of
        ``tp_size`` (default: the rank this prefill rank writes to), for a
        model of ``total_kv_heads`` (default: prefill's)."""
        if rank is None:  # the rank it writes to with equal TP sizes
            rank = self.rank if self.rank < self.decode_tp else 0
        if engine != DECODE:
            io = FakeNixlIO(f"kvpush-{engine}", layout(DST_BASE))
        elif len(self.decode_ios) > 1:
            io = self.decode_ios[rank]
        else:
            io = self.decode_io
        if total_kv_heads is None:
            total_kv_heads = self.writer._pipeline._total_kv_heads
        self.writer.on_message(
            route,
            Hello(
                engine_id=engine,
                boot_id=boot_id,
                agent_name=io.name,
                nixl_metadata=io.metadata,
                layout=decode_layout or io.layout,
                rank=rank,
                tp_size=self.decode_tp if tp_size is None else tp_size,
                total_kv_heads=total_kv_heads,
            ),
        )

    def register(
        self,
        dst: tuple[int, ...] = (10, 11, 12, 13),
        num_tokens: int = 60,
        first_block: int = 0,
        tid: str = "t1",
        ttl_s: float = 10.0,
        boot_id: str = BOOT,
        route: bytes = DECODE_ROUTE,
    ) -> None:
        reg = Registration(
            transfer_id=tid,
            decode_engine_id=DECODE,
            decode_boot_id=boot_id,
            dst_block_ids=dst,
            num_tokens=num_tokens,
            ttl_s=ttl_s,
            first_block=first_block,
            decode_tp=self.decode_tp,
        )
        self.writer.on_message(route, reg)

    def ready(
        self,
        src: tuple[int, ...] = (4, 5, 6, 9),
        num_tokens: int = 60,
        tid: str = "t1",
        req_id: str = "req-1",
        fence: object = None,
    ) -> None:
        kv = ReadyKv(
            transfer_id=tid,
            src_block_ids=src,
            num_tokens=num_tokens,
            decode_engine_id=DECODE,
        )
        self.writer.kv_ready(kv, req_id, fence or NoFence())  # type: ignore[arg-type]

    def cancel(self, tid: str = "t1", route: bytes = DECODE_ROUTE) -> None:
        """Decode's worker cancels the transfer (its request was aborted)."""
        self.writer.on_message(
            route, Cancel(transfer_id=tid, engine_id=DECODE, reason="aborted")
        )

    def reconcile(
        self, *tids: str, route: bytes = DECODE_ROUTE, engine: str = DECODE
    ) -> None:
        """Decode's worker reconnected and asks about these transfers."""
        self.writer.on_message(route, Reconcile(engine, BOOT, tids))

    def heartbeat(self, boot_id: str = BOOT) -> None:
        self.writer.on_message(
            DECODE_ROUTE, Heartbeat(engine_id=DECODE, boot_id=boot_id)
        )

    def sync(self) -> None:
        """Return once the writer has handled everything put on its inbox so
        far (it handles its inbox in order): a Hello from a probe engine is
        answered only after the earlier events."""
        self._probes += 1
        engine = f"probe{self._probes}"
        self.hello(engine=engine, route=engine.encode())
        assert wait_for(lambda: self.replies_to(engine.encode(), HelloReply))

    # -- observations ----------------------------------------------------------

    def replies_to(self, route: bytes, kind: type) -> list[Message]:
        return [m for r, m in self.replies.of(kind) if r == route]

    def wait_finished(self, req_id: str, timeout_s: float = WAIT_S) -> bool:
        def seen() -> bool:
            self.finished |= self.writer.take_finished()
            return req_id in self.finished

        return wait_for(seen, timeout_s)

    def held(self) -> dict[str, int]:
        """What the writer still holds besides its known peers (and when it
        last heard from each)."""
        pipeline = self.writer._pipeline
        held = leftovers(pipeline)
        for name in ("_matcher", "_writes", "_streams", "_to_post"):
            if len(getattr(pipeline, name)):
                held[name] = len(getattr(pipeline, name))
        return held

    def close(self) -> None:
        """Every test ends with every transfer ended: nothing may be held."""
        try:
            assert wait_for(lambda: self.held() == {}, 0.5), self.held()
        finally:
            self.writer.close()
            self.tracer.close()
        assert not self.writer._thread.is_alive(), "writer thread did not stop"
        assert self.io.misuse == [], self.io.misuse


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def expected_descs(runs: list[tuple[int, int, int]]) -> tuple[list[Desc], list[Desc]]:
    """Descriptors for ``(src_start, dst_start, length)`` runs, layer-major."""
    src, dst = [], []
    for layer in range(NUM_LAYERS):
        for s, d, n in runs:
            src.append(
                Desc(
                    SRC_BASE + layer * LAYER_BYTES + s * BLOCK_BYTES, n * BLOCK_BYTES, 0
                )
            )
            dst.append(
                Desc(
                    DST_BASE + layer * LAYER_BYTES + d * BLOCK_BYTES, n * BLOCK_BYTES, 0
                )
            )
    return src, dst


def assert_pushed_once(rig: Rig, runs: list[tuple[int, int, int]], num_blocks: int):
    writes = rig.io.writes_snapshot()
    assert len(writes) == 1
    (write,) = writes
    assert (write.src, write.dst) == expected_descs(runs)
    assert write.peer == "kvpush-d0"
    assert write.message == Done(
        transfer_id="t1", engine_id=PREFILL, num_blocks=num_blocks
    )
    assert rig.decode_io.notifications() == [write.notif]


# -- the push, in every arrival order ------------------------------------------


def test_hello_then_registration_then_ready_pushes_coalesced_runs_once(rig: Rig):
    rig.hello()
    rig.register()
    rig.ready()

    assert rig.wait_finished("req-1")
    # src [4,5,6,9] -> dst [10,11,12,13]: runs 4..6 -> 10..12 and 9 -> 13.
    assert_pushed_once(rig, [(4, 10, 3), (9, 13, 1)], num_blocks=4)
    assert rig.replies_to(DECODE_ROUTE, HelloReply) == [
        HelloReply(engine_id=PREFILL, accepted=True, boot_id="0")
    ]
    assert rig.replies.of(Failure) == []
    assert rig.writer.take_finished() == set(), "a request is released once"


def test_ready_before_registration_pushes_when_the_registration_arrives(rig: Rig):
    rig.hello()
    rig.ready()
    rig.sync()
    assert rig.io.writes_snapshot() == []

    rig.register()

    assert rig.wait_finished("req-1")
    assert_pushed_once(rig, [(4, 10, 3), (9, 13, 1)], num_blocks=4)


def test_registration_before_hello_waits_for_the_hello(rig: Rig):
    rig.register()
    rig.ready()
    rig.sync()
    assert rig.io.writes_snapshot() == [], "no peer to write to yet"
    assert rig.writer.take_finished() == set()

    rig.hello()

    assert rig.wait_finished("req-1")
    assert_pushed_once(rig, [(4, 10, 3), (9, 13, 1)], num_blocks=4)


def test_prefix_hit_on_decode_skips_the_blocks_it_already_holds(rig: Rig):
    rig.hello()
    # decode holds prompt block 0; it registers blocks 1..3 only.
    rig.register(dst=(20, 21, 22), first_block=1)
    rig.ready(src=(4, 5, 6, 9))

    assert rig.wait_finished("req-1")
    # src block 4 (prompt block 0) is not sent: 5,6 -> 20,21 and 9 -> 22.
    assert_pushed_once(rig, [(5, 20, 2), (9, 22, 1)], num_blocks=3)


def test_write_completes_only_after_polls_report_done(rig: Rig):
    rig.io.script_polls("PROC", "PROC", "PROC", "DONE")
    rig.hello()
    rig.register()
    rig.ready()

    assert rig.wait_finished("req-1")
    (write,) = rig.io.writes_snapshot()
    assert write.num_polls == 4
    assert write.released


def test_fence_is_asked_before_the_write_is_posted(rig: Rig):
    order: list[str] = []

    class RecordingFence:
        def is_ready(self) -> bool:
            order.append(f"fence asked, {len(rig.io.writes_snapshot())} writes")
            return True

    rig.hello()
    rig.register()
    rig.ready(fence=RecordingFence())

    assert rig.wait_finished("req-1")
    assert order[0] == "fence asked, 0 writes"
    assert len(rig.io.writes_snapshot()) == 1


# -- every other ending releases prefill's blocks ------------------------------


def assert_failed(rig: Rig, cause: str) -> None:
    """Exactly one Failure, for t1, with ``cause``, reached decode."""
    assert wait_for(lambda: rig.replies_to(DECODE_ROUTE, Failure))
    (failure,) = rig.replies_to(DECODE_ROUTE, Failure)
    assert isinstance(failure, Failure)
    assert (failure.transfer_id, failure.engine_id, failure.cause) == (
        "t1",
        PREFILL,
        Cause(cause),
    )


def test_write_that_fails_to_post_releases_the_request_and_tells_decode(rig: Rig):
    rig.io.fail_next_write(RuntimeError("no route to peer"))
    rig.hello()
    rig.register()
    rig.ready()

    assert rig.wait_finished("req-1")
    assert_failed(rig, "write_failed")
    assert rig.io.writes_snapshot() == []
    assert rig.decode_io.notifications() == [], "decode gets no Done"


def test_write_that_polls_err_releases_the_request_and_tells_decode(rig: Rig):
    rig.io.script_polls("PROC", "PROC", "ERR")
    rig.hello()
    rig.register()
    rig.ready()

    assert rig.wait_finished("req-1")
    assert_failed(rig, "write_failed")
    (write,) = rig.io.writes_snapshot()
    assert write.num_polls == 3
    assert rig.decode_io.notifications() == []


def test_fence_that_never_completes_releases_without_writing(rig: Rig):
    class StuckFence:
        def is_ready(self) -> bool:
            return False

    rig.hello()
    rig.register(ttl_s=1.2)  # post deadline 0.2 s after arrival
    rig.ready(fence=StuckFence())

    assert rig.wait_finished("req-1")
    assert_failed(rig, "write_failed")
    assert rig.io.writes_snapshot() == []


def test_ready_kv_nobody_registers_for_expires_and_is_released():
    rig = Rig(ready_ttl_s=0.05)
    try:
        rig.hello()
        rig.ready()

        assert rig.wait_finished("req-1")
        assert rig.io.writes_snapshot() == []
    finally:
        rig.close()


def test_cancel_from_decode_releases_pending_ready_kv_without_writing(rig: Rig):
    rig.hello()
    rig.ready()
    rig.writer.on_message(
        DECODE_ROUTE, Cancel(transfer_id="t1", engine_id=DECODE, reason="aborted")
    )

    assert rig.wait_finished("req-1")
    rig.register()  # a late registration for a cancelled transfer
    rig.sync()
    assert rig.io.writes_snapshot() == []


def test_ready_kv_after_decode_cancelled_is_released_without_writing(rig: Rig):
    rig.hello()
    rig.writer.on_message(DECODE_ROUTE, Cancel(transfer_id="t1", engine_id=DECODE))
    rig.ready()

    assert rig.wait_finished("req-1")
    rig.sync()
    assert rig.io.writes_snapshot() == []


def test_prefill_cancel_of_a_pending_registration_tells_decode(rig: Rig):
    rig.hello()
    rig.register()
    rig.writer.cancel("t1")

    assert_failed(rig, "cancelled")
    rig.ready()  # the KV turns up after all: it is released, not written
    assert rig.wait_finished("req-1")
    assert rig.io.writes_snapshot() == []


def test_registration_that_expires_before_the_kv_is_ready_tells_decode(rig: Rig):
    rig.hello()
    rig.register(ttl_s=1.05)  # deadline: ttl - post_margin_s (1.0) = 50 ms

    assert_failed(rig, "expired")
    rig.ready()
    assert rig.wait_finished("req-1")
    assert rig.io.writes_snapshot() == []


def test_incompatible_hello_is_refused_and_nothing_is_written(rig: Rig):
    rig.hello(decode_layout=layout(DST_BASE, block_bytes=2 * BLOCK_BYTES))
    assert wait_for(lambda: rig.replies_to(DECODE_ROUTE, HelloReply))
    (reply,) = rig.replies_to(DECODE_ROUTE, HelloReply)
    assert isinstance(reply, HelloReply)
    assert not reply.accepted
    assert "block_bytes" in reply.reason

    rig.register(ttl_s=1.2)  # post deadline 0.2 s after arrival
    rig.ready()
    rig.sync()
    assert rig.io.writes_snapshot() == []
    # with no accepted peer the matched transfer expires and is released
    assert rig.wait_finished("req-1")
    assert rig.io.writes_snapshot() == []
    assert rig.io.loaded_peers == ["kvpush-probe1"]


def test_hello_with_unloadable_metadata_is_refused(rig: Rig):
    rig.writer.on_message(
        DECODE_ROUTE,
        Hello(
            engine_id=DECODE,
            boot_id=BOOT,
            agent_name="kvpush-d0",
            nixl_metadata=b"junk",
            layout=layout(DST_BASE),
        ),
    )
    assert wait_for(lambda: rig.replies_to(DECODE_ROUTE, HelloReply))
    (reply,) = rig.replies_to(DECODE_ROUTE, HelloReply)
    assert isinstance(reply, HelloReply)
    assert not reply.accepted
    assert "metadata" in reply.reason


def test_trace_records_the_transfer_timeline(tmp_path: Path):
    rig = Rig(tmp_trace_dir=str(tmp_path))
    try:
        rig.hello()
        rig.register()
        rig.ready()
        assert rig.wait_finished("req-1")
    finally:
        rig.close()

    (trace,) = tmp_path.glob("p0-*.jsonl")
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    events = [line["event"] for line in lines if line["transfer_id"] == "t1"]
    assert events == ["reg_received", "kv_ready", "write_posted", "write_done"]
    posted = next(line for line in lines if line["event"] == "write_posted")
    assert (posted["num_runs"], posted["num_descs"], posted["num_blocks"]) == (2, 4, 4)
    assert all(line["engine_id"] == PREFILL for line in lines)


# -- bugs ----------------------------------------------------------------------


def test_registration_rejected_by_the_matcher_is_answered_with_a_failure():
    rig = Rig(ready_ttl_s=0.05)
    try:
        rig.hello()
        rig.ready()
        assert rig.wait_finished("req-1")  # the KV expired unmatched

        rig.register()  # arrives late: rejected as "closed"

        assert wait_for(lambda: rig.replies_to(DECODE_ROUTE, Failure), 0.5)
    finally:
        rig.close()


def test_registration_outside_decodes_cache_releases_and_fails():
    rig = Rig()
    try:
        rig.hello()
        # decode's cache has 32 blocks: block 40 does not exist there
        rig.register(dst=(10, 11, 12, 40))
        rig.ready()

        assert rig.wait_finished("req-1", timeout_s=0.5)
        assert_failed(rig, "rejected")
        assert rig.io.writes_snapshot() == [], "nothing is written out of range"
    finally:
        rig.close()
