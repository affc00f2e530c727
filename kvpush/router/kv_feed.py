"""Following the decodes' KV cache events: the ZMQ adapter around
``kv_events.py``.

``routing.py`` starts one :class:`KvEventFeed` (kvpush mode), with one task
per decode whose topology entry names a ``kv_events_endpoint``, named
``kv-events-<engine id>``. The router listens there (a ZMQ SUB socket bound
to the endpoint, every topic) and the decode engine's publisher connects to
it: vLLM's publisher binds only a wildcard address (every interface) and
connects to any other, so the listener is the router, on its own address,
and a decode's events reach one router. Each task reads batches for as
long as the router runs and applies them to the prefix index on the
router's event loop, the index's only thread. ZMQ reconnects by itself
when the decode restarts. An endpoint the router cannot bind (another
router of the same topology holds it) is logged and left: that router's
index then learns only from the requests it serves.

Sequence numbers: each batch carries its publisher's next number. A gap
(ZMQ dropped batches past its high-water mark, or the subscription began
late) or a number that went back (the decode started again) forgets what
the index knew of that engine (:meth:`~kvpush.router.kv_events.EngineEvents.
reset`), counted as outcome ``lost``. A payload that does not decode is
logged once per engine and dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from kvpush.router.kv_events import EngineEvents, decode_batch
from kvpush.router.metrics import RouterMetrics
from kvpush.router.prefix import PrefixIndex
from kvpush.router.tasks import cancel_all
from kvpush.topology import Backend

logger = logging.getLogger(__name__)

STOP_WAIT_S = 2.0  # how long closing waits for the tasks to unwind
LOST = "lost"  # outcome: batches missed (a gap, or the publisher restarted)
UNBOUND = "unbound"  # outcome: the endpoint could not be listened on


class KvEventFeed:
    """Owns the event subscriptions of one router."""

    def __init__(
        self,
        backends: Sequence[Backend],
        index: PrefixIndex,
        block_size: int,
        metrics: RouterMetrics,
    ) -> None:
        self._engines = {
            b.engine_id: (b.kv_events_endpoint, EngineEvents(
                b.engine_id, index, block_size, index.max_entries
            ))
            for b in backends
            if b.role == "decode" and b.kv_events_endpoint
        }  # fmt: skip
        self._metrics = metrics
        self._context: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def engine_ids(self) -> tuple[str, ...]:
        """The decodes followed."""
        return tuple(self._engines)

    def start(self) -> None:
        """Subscribe to every decode that publishes."""
        if self._tasks:
            raise RuntimeError("KV event feed already started")
        if not self._engines:
            return
        self._context = zmq.asyncio.Context()
        self._tasks = [
            asyncio.create_task(
                self._follow(str(endpoint), engine), name=f"kv-events-{name}"
            )
            for name, (endpoint, engine) in self._engines.items()
        ]

    async def close(self) -> None:
        """Stop following; waits at most ``STOP_WAIT_S`` for the tasks."""
        await cancel_all(self._tasks, STOP_WAIT_S)
        self._tasks = []
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def forget(self, engine_id: str) -> None:
        """``engine_id`` went down: what was known of it is gone (its next
        batch then reads as a restart, and starts afresh)."""
        entry = self._engines.get(engine_id)
        if entry is not None:
            entry[1].reset()

    async def _follow(self, endpoint: str, engine: EngineEvents) -> None:
        assert self._context is not None
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            logger.warning(
                "KV events of %s: cannot listen on %s (%s); the router goes "
                "without them",
                engine.engine_id,
                endpoint,
                e,
            )
            self._metrics.kv_event(engine.engine_id, UNBOUND)
            return
        last_seq: int | None = None
        warned = False
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    seq, payload = _parse(frames)
                    events = decode_batch(payload)
                except (ValueError, msgspec.DecodeError) as e:
                    if not warned:
                        logger.warning(
                            "KV events of %s: undecodable batch (%s); dropped",
                            engine.engine_id,
                            e,
                        )
                        warned = True
                    continue
                if last_seq is not None and seq != last_seq + 1:
                    engine.reset()
                    self._metrics.kv_event(engine.engine_id, LOST)
                last_seq = seq
                for event in events:
                    outcome = engine.apply(event)
                    self._metrics.kv_event(engine.engine_id, outcome.value)
        finally:
            sock.close(linger=0)


def _parse(frames: list[bytes]) -> tuple[int, bytes]:
    """A batch message's sequence number and payload (ValueError if it is
    not ``[topic, 8-byte number, payload]``)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"{len(frames)} frames, not [topic, seq, payload]")
    return int.from_bytes(frames[1], "big"), frames[2]
