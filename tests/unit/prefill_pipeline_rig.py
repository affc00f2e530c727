"""A prefill :class:`~kvpush.connector.prefill.pipeline.Pipeline` with no
thread: the test is its clock (every call takes an explicit ``now``; a
``tick`` runs the writer's steps once, as its loop does after reading its
inbox) and :class:`FakeNixlIO` is its NIXL. Nothing here sleeps, so an
assertion that something did not happen holds at a known time.

Prompt and blocks are ``test_connector_writer.py``'s: 60 tokens in 16-token
blocks (4 blocks), prefill's blocks 4, 5, 6, 9, decode's 10..13.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvpush.connector.counters import Counters
from kvpush.connector.faults import FaultSource
from kvpush.connector.prefill.fence import NO_FENCE, ReadyFence
from kvpush.connector.prefill.pipeline import Pipeline, Ready, WriterConfig
from kvpush.connector.prefill.transfer import Phase
from kvpush.connector.trace import Tracer
from kvpush.transfer.digest import VERIFY_OFF, VerifyPolicy
from kvpush.transfer.groups import one
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
    claim_digest,
    decode,
)
from kvpush.transfer.ranks import TpPair
from tests.fakes.fake_nixl import FakeMemory, FakeNixlIO, WriteRecord, leftovers
from tests.unit.test_connector_writer import (
    BLOCK_BYTES,
    BOOT,
    BS,
    DECODE,
    DST_BASE,
    LAYER_BYTES,
    NUM_LAYERS,
    PREFILL,
    SRC_BASE,
    Replies,
    layout,
)

HEAD_BYTES = 64  # one head of one block of one layer, with TP sizes that differ
REG_ROUTE = b"route-d0-scheduler"  # where decode's Registrations come from
TOKEN = "claim-token-of-t1"  # a late-bound transfer's claim token
FOREVER = ("PROC",) * 1_000_000 + ("DONE",)  # a WRITE that ends when told
SRC = (4, 5, 6, 9)
DST = (10, 11, 12, 13)
DONE = Done("t1", PREFILL, num_blocks=4)  # t1's Done, from prefill rank 0
WORKER = b"route-d0"  # decode's worker: the socket its Hello came from
CANCEL_ROUTE = b"route-d0-cancel"  # a socket a Cancel comes from


class FixedFaults(FaultSource):
    """Fault injection's delays, fixed (no fault file)."""

    def __init__(self, ready_delay_s: float = 0.0, post_delay_s: float = 0.0) -> None:
        super().__init__("")
        self._ready_delay_s, self._post_delay_s = ready_delay_s, post_delay_s

    def ready_delay_s(self) -> float:
        return self._ready_delay_s

    def post_delay_s(self) -> float:
        return self._post_delay_s


@dataclass(frozen=True)
class Decode:
    """One decode rank's fake agent and the socket its Hello comes from."""

    io: FakeNixlIO
    route: bytes


class PipelineRig:
    """Prefill rank ``rank`` of ``tp_size``, pushing to decode ``d0`` of
    ``decode_tp`` ranks (default: prefill's TP size); each decode rank has
    its own fake agent, linked to prefill's."""

    def __init__(
        self,
        *,
        ready_ttl_s: float = 30.0,
        peer_timeout_s: float = 10.0,
        write_timeout_s: float = 30.0,
        num_layers: int = NUM_LAYERS,
        tp_size: int = 1,
        rank: int = 0,
        decode_tp: int | None = None,
        total_kv_heads: int = 0,
        faults: FaultSource | None = None,
        verify: VerifyPolicy = VERIFY_OFF,
    ) -> None:
        self.rank, self.tp_size = rank, tp_size
        self.decode_tp = decode_tp or tp_size
        self.total_kv_heads = total_kv_heads
        pair = TpPair(tp_size, self.decode_tp, total_kv_heads)
        src_bytes = dst_bytes = [BLOCK_BYTES] * self.decode_tp
        if not pair.is_homogeneous:
            m = pair.mapping
            src_bytes = [m.prefill_share(rank).num_heads * HEAD_BYTES]
            dst_bytes = [
                m.decode_share(d).num_heads * HEAD_BYTES for d in range(self.decode_tp)
            ]
        self.io = FakeNixlIO(
            f"kvpush-p0-rank{rank}",
            layout(SRC_BASE, src_bytes[0], num_layers=num_layers),
        )
        self.memory = FakeMemory(self.io.layout)
        self.decodes = [
            Decode(
                FakeNixlIO(
                    f"kvpush-d0-rank{d}",
                    layout(DST_BASE, dst_bytes[d], num_layers=num_layers),
                ),
                b"route-d0" if self.decode_tp == 1 else b"route-d0-rank%d" % d,
            )
            for d in range(self.decode_tp)
        ]
        for d in self.decodes:
            self.io.link(d.io)
        self.others: dict[str, Decode] = {}  # other decode engines, one rank
        self.replies = Replies()
        self.finished: list[str] = []
        self.counters = Counters()
        self.tracer = Tracer("", PREFILL)
        config = WriterConfig(
            PREFILL,
            MatcherConfig(block_size=BS, ready_ttl_s=ready_ttl_s),
            peer_timeout_s=peer_timeout_s,
            write_timeout_s=write_timeout_s,
            tp_size=tp_size,
            rank=rank,
            total_kv_heads=total_kv_heads,
            verify=verify,
        )
        self.pipeline = Pipeline(
            self.io,  # type: ignore[arg-type]
            config,
            self.replies,
            self.finished.append,
            self.tracer,
            self.counters,
            faults or FaultSource(""),
            self.memory,
        )

    # -- the clock ---------------------------------------------------------------

    def tick(self, now: float) -> None:
        """One turn of the writer's loop after its inbox was read."""
        for step in self.pipeline.steps:
            step(now)

    # -- decode's messages -----------------------------------------------------

    def decode(self, engine: str = DECODE, rank: int = 0) -> Decode:
        """Decode ``engine``'s rank ``rank`` (another engine than ``d0``:
        one rank, its agent made and linked on first use)."""
        if engine == DECODE:
            return self.decodes[min(rank, len(self.decodes) - 1)]
        if engine not in self.others:
            io = FakeNixlIO(f"kvpush-{engine}", self.decodes[0].io.layout)
            self.io.link(io)
            self.others[engine] = Decode(io, f"route-{engine}".encode())
        return self.others[engine]

    def hello(
        self,
        now: float,
        rank: int | None = None,
        boot: str = BOOT,
        engine: str = DECODE,
        tp_size: int | None = None,
        decode_layout: KvLayout | None = None,
    ) -> HelloReply:
        """Decode rank ``rank`` (default: the one this prefill rank writes,
        or rank 0) says Hello; the reply."""
        if rank is None:
            rank = self.rank if self.rank < self.decode_tp else 0
        d = self.decode(engine, rank)
        route = d.route
        hello = Hello(
            engine_id=engine,
            boot_id=boot,
            agent_name=d.io.name,
            nixl_metadata=d.io.metadata,
            layout=decode_layout or d.io.layout,
            rank=rank,
            tp_size=self.decode_tp if tp_size is None else tp_size,
            total_kv_heads=self.total_kv_heads,
        )
        self.pipeline.on_message(route, hello, now)
        reply = self.sent_to(route)[-1]
        assert isinstance(reply, HelloReply)
        return reply

    def hellos(self, now: float) -> None:
        """Every decode rank this prefill rank writes says Hello."""
        pair = TpPair(self.tp_size, self.decode_tp, self.total_kv_heads)
        for rank in sorted(pair.target_ranks(self.rank)):
            assert self.hello(now, rank=rank).accepted

    def register(
        self,
        now: float,
        tid: str = "t1",
        dst: tuple[int, ...] = DST,
        first_block: int = 0,
        ttl_s: float = 10.0,
        boot: str = BOOT,
        engine: str = DECODE,
        route: bytes = REG_ROUTE,
        token: str | None = None,
        decode_tp: int | None = None,
    ) -> None:
        reg = Registration(
            transfer_id=tid,
            decode_engine_id=engine,
            decode_boot_id=boot,
            dst_block_ids=one(dst),
            num_tokens=60,
            ttl_s=ttl_s,
            first_block=first_block,
            decode_tp=decode_tp or self.decode_tp,
            claim_token=token,
        )
        self.pipeline.on_message(route, reg, now)

    def cancel(
        self,
        now: float,
        route: bytes = REG_ROUTE,
        tid: str = "t1",
        engine: str = DECODE,
    ) -> None:
        self.pipeline.on_message(route, Cancel(tid, engine, "aborted"), now)

    def reconcile(
        self, now: float, route: bytes, *tids: str, engine: str = DECODE
    ) -> None:
        self.pipeline.on_message(route, Reconcile(engine, BOOT, tids or ("t1",)), now)

    def heartbeat(self, now: float) -> None:
        self.pipeline.on_message(self.decodes[0].route, Heartbeat(DECODE, BOOT), now)

    # -- prefill's events ------------------------------------------------------

    def ready(
        self,
        now: float,
        src: tuple[int, ...] = SRC,
        tid: str = "t1",
        req_id: str = "req-1",
        fence: ReadyFence = NO_FENCE,
        first: int = 0,
        final: bool = True,
        late: bool = False,
        token: str = TOKEN,
    ) -> None:
        """Prefill's KV of ``tid`` (a whole prompt, or the chunk of prompt
        blocks ``first..``) is computed once ``fence`` says so; ``late``:
        its leg named no decode, only the claim digest of ``token``."""
        decode, digest = (None, claim_digest(token)) if late else (DECODE, None)
        kv = ReadyKv(tid, one(src), 60, decode, first, final, claim_sha256=digest)
        self.pipeline.on_ready(Ready(kv, req_id, fence), now)

    # -- observations ------------------------------------------------------------

    def sent_to(self, route: bytes) -> list[Message]:
        return [m for r, m in self.replies.sent if r == route]

    def failures(self, route: bytes | None = None) -> list[tuple[str, Cause]]:
        """(transfer id, cause) of each Failure sent (on ``route``)."""
        return [
            (m.transfer_id, m.cause)
            for r, m in self.replies.of(Failure)
            if isinstance(m, Failure) and route in (None, r)
        ]

    def writes(self) -> list[WriteRecord]:
        return self.io.writes_snapshot()

    def notifications(self, rank: int = 0, engine: str = DECODE) -> list[Message]:
        """The Done notifications decode rank ``rank`` received."""
        io = self.decode(engine, rank).io
        return [decode(n) for n in io.notifications()]

    def phase(self, tid: str = "t1") -> Phase | None:
        """The phase of ``tid``'s record (None: the pipeline holds none)."""
        transfer = self.pipeline.transfer(tid)
        return None if transfer is None else transfer.phase

    def held(self) -> dict[str, int]:
        """What the pipeline still holds besides its known peers."""
        p = self.pipeline
        held = leftovers(p)
        for name in ("_matcher", "_writes", "_tell"):
            if len(getattr(p, name)):
                held[name] = len(getattr(p, name))
        return held

    def assert_nothing_held(self) -> None:
        assert self.held() == {}, self.held()
        assert self.io.misuse == [], self.io.misuse


def end_write(write: WriteRecord, state: str = "DONE") -> None:
    """A WRITE scripted to run for ever (:data:`FOREVER`) ends at its next
    poll, as ``state`` says."""
    write.states = deque([state])


def blocks_of(write: WriteRecord) -> dict[int, tuple[list[int], list[int]]]:
    """Per layer, (prefill blocks, decode blocks) one WRITE copies (whole
    blocks of :data:`BLOCK_BYTES`)."""
    out: dict[int, tuple[list[int], list[int]]] = {}
    for s, d in zip(write.src, write.dst, strict=True):
        layer, offset = divmod(s.addr - SRC_BASE, LAYER_BYTES)
        first_d = (d.addr - DST_BASE - layer * LAYER_BYTES) // BLOCK_BYTES
        n = s.length // BLOCK_BYTES
        src, dst = out.setdefault(layer, ([], []))
        src += range(offset // BLOCK_BYTES, offset // BLOCK_BYTES + n)
        dst += range(first_d, first_d + n)
    return out


class Fence:
    """A forward's device fence that completes when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def is_ready(self) -> bool:
        return self.done


def pushed(rig: PipelineRig, now: float = 0.0) -> PipelineRig:
    """Decode said Hello and registered t1; prefill's KV of t1 is in; one
    tick posted its WRITE."""
    rig.hello(now)
    rig.register(now)
    rig.ready(now)
    rig.tick(now)
    return rig


def running() -> tuple[PipelineRig, WriteRecord]:
    """t1's one WRITE posted and running until the test ends it."""
    rig = PipelineRig()
    rig.io.script_polls(*FOREVER)
    pushed(rig)
    (write,) = rig.writes()
    return rig, write
