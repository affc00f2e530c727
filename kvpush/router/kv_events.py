"""What a decode holds, from vLLM's KV cache events (pure).

A vLLM instance started with ``--kv-events-config`` (publisher ``zmq``)
publishes, after each engine step, a batch of the block events of that
step: ``BlockStored`` (blocks it cached: their vLLM hashes, the hash of the
block before them, their token ids), ``BlockRemoved`` (blocks it evicted)
and ``AllBlocksCleared``. On the wire each batch is a ZMQ multipart message
``[topic, sequence number (8 bytes, big-endian), msgpack payload]``; the
payload is an array ``[ts, events, data_parallel_rank]`` whose events are
maps tagged by their ``type`` (vLLM's ``vllm/distributed/kv_events.py``).

:class:`EngineEvents` turns one engine's events into the router's own block
hashes (:func:`~kvpush.router.prefix.block_hashes`, chained from the token
ids) and applies them to the :class:`~kvpush.router.prefix.PrefixIndex`:
stored blocks are recorded, removed ones removed, a clear forgets the
engine. vLLM's hashes cannot be computed here (they are seeded per
process), so it keeps, per engine, which of its hashes is which of ours.

What it refuses to guess, counted by :class:`Outcome`: a block whose parent
it never saw stored (the router started after it, or events were lost) is
not placed; blocks of another size than the router's ``block_size``, of a
LoRA adapter, with extra hash keys (multimodal inputs, a cache salt) or of a
KV-cache group other than the first are skipped, since the router's hashes
cover token ids only. A gap in the sequence numbers (ZMQ dropped batches)
or a publisher that started again forgets the engine (:meth:`EngineEvents.
reset`): the index then says "not held" until new events or served
requests say otherwise, which costs a needless prefill leg, never a wrong
answer (decode computes what it lacks).
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from typing import Any

import msgspec

from kvpush.router.prefix import PrefixIndex, block_hashes

logger = logging.getLogger(__name__)

VllmHash = int | bytes  # vLLM's ExternalBlockHash


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[VllmHash]
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_event_decoder = msgspec.msgpack.Decoder(Event)  # type: ignore[arg-type]


class Outcome(enum.Enum):
    """What became of one event (counted per engine by the router)."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    UNPLACED = "unplaced"  # its parent block was never seen stored
    SKIPPED = "skipped"  # not comparable with the router's hashes
    UNKNOWN = "unknown"  # an event type this router does not know


def decode_batch(payload: bytes) -> list[Event | None]:
    """A batch's events, in order; None for each of an unknown type.
    msgspec.DecodeError when the payload is not a batch."""
    batch = _batch_decoder.decode(payload)
    out: list[Event | None] = []
    for raw in batch.events:
        try:
            out.append(_event_decoder.decode(raw))
        except msgspec.ValidationError:
            out.append(None)  # a newer vLLM's event: leave it
    return out


class EngineEvents:
    """One decode engine's events, applied to the router's prefix index.

    ``max_blocks`` bounds the map from vLLM's hashes to the router's (the
    index's own bound: an engine cannot usefully hold more), least recently
    stored dropped first.
    """

    def __init__(
        self, engine_id: str, index: PrefixIndex, block_size: int, max_blocks: int
    ) -> None:
        self.engine_id = engine_id
        self._index = index
        self._block_size = block_size
        self._max_blocks = max_blocks
        self._ours: OrderedDict[VllmHash, int] = OrderedDict()

    def apply(self, event: Event | None) -> Outcome:
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            if event.group_idx:
                return Outcome.SKIPPED
            gone = [self._ours.pop(h, None) for h in event.block_hashes]
            self._index.remove(self.engine_id, (h for h in gone if h is not None))
            return Outcome.REMOVED
        if isinstance(event, AllBlocksCleared):
            self.reset()
            return Outcome.CLEARED
        return Outcome.UNKNOWN

    def reset(self) -> None:
        """Forget what the engine holds (events were lost, or it restarted)."""
        self._ours.clear()
        self._index.forget(self.engine_id)

    def _stored(self, event: BlockStored) -> Outcome:
        size = self._block_size
        if (
            event.block_size != size
            or event.lora_id is not None
            or event.group_idx
            or any(k is not None for k in event.extra_keys or ())
            or len(event.token_ids) != size * len(event.block_hashes)
        ):
            return Outcome.SKIPPED
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = self._ours.get(event.parent_block_hash)
            if parent is None:
                return Outcome.UNPLACED
        ours = block_hashes(event.token_ids, size, parent)
        for theirs, mine in zip(event.block_hashes, ours, strict=True):
            self._ours[theirs] = mine
            self._ours.move_to_end(theirs)
        while len(self._ours) > self._max_blocks:
            self._ours.popitem(last=False)
        self._index.record(self.engine_id, ours)
        return Outcome.STORED
