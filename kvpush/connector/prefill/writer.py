"""Prefill's background writer thread: the one owner of every push.

Other threads only put events on its inbox: the listener thread (Hello,
Registration, Cancel, Heartbeat from decodes) and the worker's main thread
(KV ready, prefill cancelled a request, vLLM preempted requests). The engine
loop never waits on it (a preempted request's blocks stay allocated while a
WRITE reads them: the scheduler pins them until the request id comes out
of :meth:`Writer.take_finished`). The state machine itself is
:class:`~kvpush.connector.prefill.pipeline.Pipeline`; this module is its
thread, inbox and clock.

Each loop: wait for the first event (at most until the next deadline or
poll), then take every event already queued, and only then run the due
work, poll WRITEs and judge deadlines and silence: silence is judged only
after reading what is already queued. A loop that finds its own clock
jumped (the process was stopped, e.g. SIGSTOP) pardons its peers for the
gap instead of blaming them.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvpush.connector.counters import Counters
from kvpush.connector.faults import FaultSource
from kvpush.connector.kv_bytes import KvBytes
from kvpush.connector.nixl_io import NixlIO
from kvpush.connector.prefill.fence import LayerFences, ReadyFence
from kvpush.connector.prefill.pipeline import Pipeline, Ready, WriterConfig
from kvpush.connector.trace import Tracer
from kvpush.transfer.matcher import ReadyKv
from kvpush.transfer.messages import Message, Registration, SampleLogprobs

logger = logging.getLogger(__name__)

STALL_S = 2.0  # a loop gap this long means this process was stopped
JOIN_S = 5.0  # close(): how long to wait for the thread (it wakes every 0.1 s)
DRAIN_S = 10.0  # close(): how long to wait for the WRITEs in flight to end
DRAIN_POLL_S = 0.001


class Kind(enum.Enum):
    """What an inbox entry carries."""

    MESSAGE = "message"  # (route, Message) from the listener thread
    READY = "ready"  # Ready from the worker's main thread
    LAYER = "layer"  # (LayerFences, layer, fence) from the worker's main thread
    CANCEL = "cancel"  # transfer id prefill gave up
    PREEMPT = "preempt"  # transfer ids from the worker's main thread
    FIRST_TOKEN = "first_token"  # (transfer id, token id, logprobs), main thread
    STOP = "stop"


class Writer:
    """Runs the push pipeline of one prefill worker in thread ``kvpush-writer``."""

    def __init__(
        self,
        io: NixlIO,
        config: WriterConfig,
        reply: Callable[[bytes, Message], None],
        tracer: Tracer,
        counters: Counters | None = None,
        faults: FaultSource | None = None,
        memory: KvBytes | None = None,
    ) -> None:
        """``memory``: this worker's KV bytes, which KV digests hash
        (``config.verify``); None: no digests are sent."""
        self._tracer = tracer
        self._finished: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._pipeline = Pipeline(
            io,
            config,
            reply,
            self._finished.put,
            tracer,
            counters or Counters(),
            faults or FaultSource(""),
            memory,
        )
        self._inbox: queue.SimpleQueue[tuple[Kind, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvpush-writer", daemon=True
        )
        self._thread.start()

    # -- any thread ------------------------------------------------------------

    def on_message(self, route: bytes, message: Message) -> None:
        """From the listener thread: a message from a decode."""
        if isinstance(message, Registration):
            engine = message.decode_engine_id
            self._tracer.mark(message.transfer_id, "reg_received", peer=engine)
        self._inbox.put((Kind.MESSAGE, (route, message)))

    def kv_ready(
        self, ready: ReadyKv, req_id: str, fence: ReadyFence, mark_ready: bool = True
    ) -> None:
        """From the worker's main thread, right after the forward that
        computed the prompt's last token (streamed: each chunk's, in prompt
        order; the last one is ``final`` and marks ``kv_ready``; a chunk
        pushed per layer comes before its forward, and is marked by
        :meth:`kv_computed` after it)."""
        if mark_ready:
            self.kv_computed([ready])
        self._inbox.put((Kind.READY, Ready(ready, req_id, fence)))

    def kv_computed(self, chunks: list[ReadyKv]) -> None:
        """The forward computing ``chunks`` ended: the final ones mark
        ``kv_ready`` (main thread; the tracer is thread-safe)."""
        for ready in chunks:
            if ready.final:  # a late-bound KV learns its peer at the match
                peer = {} if ready.is_late else {"peer": ready.decode_engine_id}
                self._tracer.mark(ready.transfer_id, "kv_ready", **peer)

    def layer_saved(self, fences: LayerFences, layer: int, fence: ReadyFence) -> None:
        """From the worker's main thread, in ``save_kv_layer`` (per layer,
        only in forwards that compute chunks pushed per layer) and at
        ``wait_for_save`` (``layer`` ALL_LAYERS): that layer's KV is written
        once ``fence`` says so. Only puts a tuple on the inbox."""
        self._inbox.put((Kind.LAYER, (fences, layer, fence)))

    def cancel(self, transfer_id: str) -> None:
        """From the worker's main thread: prefill gave the request up."""
        self._inbox.put((Kind.CANCEL, transfer_id))

    def first_token(
        self, transfer_id: str, token_id: int, logprobs: SampleLogprobs | None
    ) -> None:
        """From the worker's main thread: the token prefill sampled after
        the prompt of an early-bound transfer (and its logprobs, where
        asked), for its decode."""
        self._inbox.put((Kind.FIRST_TOKEN, (transfer_id, token_id, logprobs)))

    def preempt(self, transfer_ids: set[str]) -> None:
        """From the worker's main thread, for requests vLLM preempted: close
        those transfers (nothing more of them is posted) without waiting. A
        WRITE in flight runs to its end; the request id comes out of
        :meth:`take_finished` only once none reads its blocks."""
        if transfer_ids:
            self._inbox.put((Kind.PREEMPT, frozenset(transfer_ids)))

    def take_finished(self) -> set[str]:
        """Request ids whose push ended since the last call (main thread)."""
        out = set()
        while True:
            try:
                out.add(self._finished.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout_s: float = JOIN_S, drain_s: float = DRAIN_S) -> bool:
        """Stop the thread (nothing more is posted), then wait up to
        ``drain_s`` for the WRITEs in flight to end; none is cancelled.
        True when the thread ended and NIXL let go of every WRITE: only
        then may the side channel close (a loopback decode takes that as
        proof that nothing more will land) and memory be deregistered."""
        self._stop.set()
        self._inbox.put((Kind.STOP, None))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("kvpush writer: did not stop within %.0f s", timeout_s)
            return False
        deadline = time.monotonic() + drain_s
        while (left := self._pipeline.drain(time.monotonic())) > 0:
            if time.monotonic() >= deadline:
                logger.error("kvpush writer: %d WRITE(s) still run at shutdown", left)
                return False
            time.sleep(DRAIN_POLL_S)
        return True

    # -- writer thread -------------------------------------------------------

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            events = self._next_events(self._pipeline.wait_s(time.monotonic()))
            now = time.monotonic()
            if now - last > STALL_S:
                self._pipeline.pardon(now, now - last)
            last = now
            for kind, item in events:
                self._guarded(self._handle, kind, item, now)
            for step in self._pipeline.steps:
                self._guarded(step, now)

    def _next_events(self, wait_s: float) -> list[tuple[Kind, Any]]:
        """The first event (waiting up to ``wait_s``) and every one queued."""
        events = []
        try:
            events.append(self._inbox.get(timeout=wait_s))
            while True:
                events.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return events

    def _handle(self, kind: Kind, item: Any, now: float) -> None:
        p = self._pipeline
        if kind is Kind.MESSAGE:
            p.on_message(item[0], item[1], now)
        elif kind is Kind.READY:
            p.on_ready(item, now)
        elif kind is Kind.LAYER:
            p.on_layer_saved(*item)
        elif kind is Kind.CANCEL:
            p.on_prefill_cancel(item, now)
        elif kind is Kind.PREEMPT:
            p.on_preempt(item, now)
        elif kind is Kind.FIRST_TOKEN:
            p.on_first_token(*item)

    @staticmethod
    def _guarded(step: Callable[..., None], *args: Any) -> None:
        """Run one step; the writer must outlive any single failure, and a
        failure in one step must not stop the others (deadlines included)."""
        try:
            step(*args)
        except Exception:
            logger.exception("kvpush writer: unexpected error")
