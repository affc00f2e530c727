"""The prefill writer thread pushes a prompt's KV into decode's blocks
once, through its inbox, and frees prefill's blocks (``take_finished``);
its trace records the transfer's timeline.

Each test runs a real writer thread over :class:`FakeNixlIO`; a recording
``reply`` stands in for the side-channel listener. :class:`Rig` serves the
other thread-rig tests. The state machine itself (every phase, every
ending, every arrival order) is tested without a thread in
``test_prefill_pipeline.py`` and ``test_prefill_pipeline_stream.py``.
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
from kvpush.transfer.groups import one
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.matcher import MatcherConfig, ReadyKv
from kvpush.transfer.messages import (
    Cancel,
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
            dst_block_ids=one(dst),
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
            src_block_ids=one(src),
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
        for name in ("_matcher", "_writes"):
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
    rig.sync()  # the writer ticked since
    assert rig.writer.take_finished() == set(), "a request is released once"


# -- every other ending releases prefill's blocks ------------------------------


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
