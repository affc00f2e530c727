"""Part c: the prefill writer thread's CPU in four states, with a stand-in
NIXL (:class:`_StuckNixl`) whose WRITEs never finish:

* idle: no transfer at all (the floor: a wake every 0.1 s);
* waiting: 1000 transfers registered by decode whose KV is not ready, so
  they wait in the matcher, and no WRITE in flight;
* in flight: 100 WRITEs in flight (each polled on every wake, every 0.5 ms),
  nothing waiting;
* both: the 1000 waiting and the 100 in flight, so the matcher is asked on
  every 0.5 ms wake: what it costs beyond "in flight" is the matcher's.

The CPU is read from the writer thread's own clock
(``time.pthread_getcpuclockid``) over repeated windows while this thread
sleeps, and reported as % of one core. Nothing here is a test fake: the
stand-in lives in this module because production code does not import
``tests/``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

from kvpush.connector.nixl_io import NixlIO, XferState
from kvpush.connector.prefill.fence import NoFence
from kvpush.connector.prefill.pipeline import WriterConfig
from kvpush.connector.prefill.writer import Writer
from kvpush.connector.trace import Tracer
from kvpush.transfer.groups import one
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.matcher import MatcherConfig, ReadyKv
from kvpush.transfer.messages import Hello, HelloReply, Message, Registration
from kvpush_lab.bench.micro.build import layout
from kvpush_lab.bench.micro.report import CpuTiming
from kvpush_lab.bench.micro.stats import Spread

NUM_WAITING = 1000
NUM_INFLIGHT = 100
BLOCKS_PER_TRANSFER = 4
BLOCK_SIZE = 16
LONG_S = 3000.0  # no deadline, liveness or WRITE timeout inside a run
SETTLE_S = 0.5  # after the state is reached, before the first window
REACH_S = 30.0  # longest wait for the writer to reach a state
DECODE, BOOT, ROUTE = "bench-d0", "boot-0", b"bench-route"


class _StuckNixl:
    """Stands in for :class:`~kvpush.connector.nixl_io.NixlIO`: loads any
    peer, accepts every WRITE and reports it in flight until :meth:`finish`
    (then done, so that closing the writer need not wait out its drain)."""

    mem_type = "DRAM"

    def __init__(self, name: str, kv_layout: KvLayout) -> None:
        self.name, self.layout = name, kv_layout
        self.metadata = b"bench:" + name.encode()
        self.num_writes = self.num_polls = 0  # written by the writer thread
        self._finished = threading.Event()

    def finish(self) -> None:
        """Every WRITE posted so far, or later, is done."""
        self._finished.set()

    def load_peer(self, agent_name: str, metadata: bytes) -> str:
        return agent_name

    def write(self, src: Any, dst: Any, peer: str, notif: bytes) -> object:
        self.num_writes += 1
        return object()

    def state(self, handle: Any) -> XferState:
        self.num_polls += 1
        return XferState.DONE if self._finished.is_set() else XferState.PROC

    def release(self, handle: Any) -> bool:
        return True

    def notifications(self) -> list[bytes]:
        return []

    def close(self) -> None:
        pass


class _Replies:
    """The writer's reply callable: remembers who got a HelloReply."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hello_replies: set[bytes] = set()

    def __call__(self, route: bytes, message: Message) -> None:
        if isinstance(message, HelloReply):
            with self._lock:
                self._hello_replies.add(route)

    def answered(self, route: bytes) -> bool:
        with self._lock:
            return route in self._hello_replies


def measure_writer_cpu(
    num_windows: int,
    window_s: float,
    settle_s: float = SETTLE_S,
    num_waiting: int = NUM_WAITING,
    num_inflight: int = NUM_INFLIGHT,
) -> list[CpuTiming]:
    """The four states, each on a fresh writer, closed afterwards."""
    states = (
        ("idle", 0, 0),
        ("waiting for KV", num_waiting, 0),
        ("WRITEs in flight", 0, num_inflight),
        ("waiting + in flight", num_waiting, num_inflight),
    )
    return [
        _measure(state, waiting, inflight, num_windows, window_s, settle_s)
        for state, waiting, inflight in states
    ]


def _measure(
    state: str,
    num_waiting: int,
    num_inflight: int,
    num_windows: int,
    window_s: float,
    settle_s: float,
) -> CpuTiming:
    num_blocks = BLOCKS_PER_TRANSFER * (num_waiting + num_inflight) + 8
    kv_layout = layout(0x7F00_0000_0000, num_blocks=num_blocks, num_layers=80)
    io = _StuckNixl("bench-p0", kv_layout)
    replies = _Replies()
    before = set(threading.enumerate())
    matcher = MatcherConfig(
        block_size=BLOCK_SIZE,
        ready_ttl_s=LONG_S,
        max_pending=max(4096, num_waiting + num_inflight),
    )
    config = WriterConfig(
        "bench-p0", matcher, peer_timeout_s=LONG_S, write_timeout_s=LONG_S
    )
    writer = Writer(cast(NixlIO, io), config, replies, Tracer("", "bench-p0"))
    (thread,) = [
        t for t in set(threading.enumerate()) - before if t.name == "kvpush-writer"
    ]
    try:
        _hello(writer, DECODE, ROUTE, kv_layout)
        for i in range(num_waiting + num_inflight):
            _register(writer, f"t{i}", i)
        for i in range(num_waiting, num_waiting + num_inflight):
            _ready(writer, f"t{i}", i)
        _hello(writer, "bench-probe", b"probe", kv_layout)  # handled after all
        _wait(lambda: replies.answered(b"probe"), "handle its inbox")
        _wait(lambda: io.num_writes == num_inflight, f"post {num_inflight} WRITEs")
        time.sleep(settle_s)
        clock = time.pthread_getcpuclockid(thread.ident or 0)
        windows = [_window(clock, io, window_s) for _ in range(num_windows)]
    finally:
        io.finish()
        writer.close()
    percent = Spread.of([w[0] for w in windows])
    polls = Spread.of([w[1] for w in windows])
    return CpuTiming(state, num_waiting, num_inflight, percent, window_s, polls)


def _window(clock: int, io: _StuckNixl, window_s: float) -> tuple[float, float]:
    """% of a core the writer thread used over ``window_s``, and how many
    WRITE polls a second it made."""
    cpu0, polls0, wall0 = time.clock_gettime(clock), io.num_polls, time.perf_counter()
    time.sleep(window_s)
    cpu1, polls1, wall1 = time.clock_gettime(clock), io.num_polls, time.perf_counter()
    wall = wall1 - wall0
    return 100.0 * (cpu1 - cpu0) / wall, (polls1 - polls0) / wall


def _wait(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + REACH_S
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the writer did not {what} within {REACH_S:.0f} s")
        time.sleep(0.01)


def _hello(writer: Writer, engine: str, route: bytes, kv_layout: KvLayout) -> None:
    hello = Hello(
        engine_id=engine,
        boot_id=BOOT,
        agent_name=f"{engine}-agent",
        nixl_metadata=b"bench:" + engine.encode(),
        layout=kv_layout,
    )
    writer.on_message(route, hello)


def _blocks(i: int) -> tuple[int, ...]:
    return tuple(range(i * BLOCKS_PER_TRANSFER, (i + 1) * BLOCKS_PER_TRANSFER))


def _register(writer: Writer, tid: str, i: int) -> None:
    reg = Registration(
        transfer_id=tid,
        decode_engine_id=DECODE,
        decode_boot_id=BOOT,
        dst_block_ids=one(_blocks(i)),
        num_tokens=BLOCKS_PER_TRANSFER * BLOCK_SIZE,
        ttl_s=LONG_S,
        first_block=0,
    )
    writer.on_message(ROUTE, reg)


def _ready(writer: Writer, tid: str, i: int) -> None:
    kv = ReadyKv(tid, one(_blocks(i)), BLOCKS_PER_TRANSFER * BLOCK_SIZE, DECODE)
    writer.kv_ready(kv, f"req-{tid}", NoFence())
