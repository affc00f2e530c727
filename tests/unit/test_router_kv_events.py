"""vLLM's KV cache events applied to the router's prefix index: batches
encoded by vLLM's own event classes, decoded by the router's, and what each
event does to what the index says a decode holds; the feed that follows a
decode's ZMQ publisher, and what a gap in its sequence numbers does."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import msgspec
import pytest
import zmq
from vllm.distributed import kv_events as vllm_events

from kvpush.router.kv_events import EngineEvents, Outcome, decode_batch
from kvpush.router.kv_feed import KvEventFeed
from kvpush.router.metrics import RouterMetrics
from kvpush.router.prefix import PrefixIndex, block_hashes
from kvpush.telemetry import names
from kvpush.topology import Backend

BS = 4
TOKENS = list(range(100, 116))  # four blocks


def _stored(hashes: list, parent, tokens: list[int], **extra) -> object:
    fields = {"lora_id": None, "medium": "GPU", "lora_name": None, **extra}
    return vllm_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        **fields,
    )


def _wire(*events: object) -> bytes:
    batch = vllm_events.KVEventBatch(ts=1.0, events=list(events))
    return msgspec.msgpack.encode(batch)


def _engine(index: PrefixIndex) -> EngineEvents:
    return EngineEvents("decode0", index, BS, max_blocks=100)


def _apply(engine: EngineEvents, *events: object) -> list[Outcome]:
    return [engine.apply(e) for e in decode_batch(_wire(*events))]


def test_stored_blocks_are_held_in_the_routers_own_hashes() -> None:
    """Two batches store a prompt's four blocks (the second chained to the
    first by vLLM's parent hash, as after a prefix hit): the index holds
    exactly the hashes the router computes for that prompt."""
    index = PrefixIndex(100)
    engine = _engine(index)
    assert _apply(engine, _stored([b"a", b"b"], None, TOKENS[:8])) == [Outcome.STORED]
    assert _apply(engine, _stored([b"c", b"d"], b"b", TOKENS[8:])) == [Outcome.STORED]
    ours = block_hashes(TOKENS, BS)
    assert index.num_held_blocks("decode0", ours) == 4
    assert index.num_held_blocks("decode1", ours) == 0
    other = block_hashes([7, *TOKENS[1:]], BS)
    assert index.num_held_blocks("decode0", other) == 0


def test_removed_blocks_and_a_clear_are_forgotten() -> None:
    index = PrefixIndex(100)
    engine = _engine(index)
    _apply(engine, _stored([1, 2, 3, 4], None, TOKENS))
    ours = block_hashes(TOKENS, BS)
    assert _apply(engine, vllm_events.BlockRemoved([3], medium="GPU")) == [
        Outcome.REMOVED
    ]
    assert index.num_held_blocks("decode0", ours) == 2  # blocks 0 and 1 lead
    index.record("decode0", ours[:1])  # the router's own record goes too:
    assert _apply(engine, vllm_events.AllBlocksCleared()) == [Outcome.CLEARED]
    assert index.num_held_blocks("decode0", ours) == 0


def test_blocks_it_cannot_compare_are_not_guessed() -> None:
    """A parent never seen stored (events before the router started), another
    block size, a LoRA adapter, extra hash keys, another KV-cache group:
    nothing is recorded."""
    index = PrefixIndex(100)
    engine = _engine(index)
    wrong_size = vllm_events.BlockStored(
        block_hashes=[9],
        parent_block_hash=None,
        token_ids=TOKENS[:8],
        block_size=8,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    outcomes = _apply(
        engine,
        _stored([5], b"never-seen", TOKENS[4:8]),
        wrong_size,
        _stored([6], None, TOKENS[:4], lora_id=1),
        _stored([7], None, TOKENS[:4], extra_keys=[("salt",)]),
        _stored([8], None, TOKENS[:4], group_idx=1),
    )
    assert outcomes == [Outcome.UNPLACED] + [Outcome.SKIPPED] * 4
    assert len(index) == 0


def test_an_unknown_event_type_is_left_and_a_bad_payload_refused() -> None:
    class FutureEvent(vllm_events.KVCacheEvent):
        what: int = 1

    index = PrefixIndex(100)
    outcomes = _apply(_engine(index), FutureEvent(), _stored([1], None, TOKENS[:4]))
    assert outcomes == [Outcome.UNKNOWN, Outcome.STORED]
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\xc1 not msgpack")


def test_the_hash_map_is_bounded() -> None:
    index = PrefixIndex(100)
    engine = EngineEvents("decode0", index, BS, max_blocks=2)
    _apply(engine, _stored([1, 2, 3, 4], None, TOKENS))
    # the first two were dropped from the map: their removal cannot be
    # placed, the last two's can
    _apply(engine, vllm_events.BlockRemoved([1, 2, 3, 4], medium="GPU"))
    ours = block_hashes(TOKENS, BS)
    assert index.num_held_blocks("decode0", ours) == 2


# -- the feed: a real ZMQ publisher in this process -----------------------------------


class _Publisher:
    """vLLM's wire: [topic, 8-byte big-endian sequence number, batch], from
    a PUB socket that connects to the router's endpoint (as vLLM's does to
    an address that is not a wildcard)."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.PUB)
        self.sock.connect(endpoint)
        self.seq = 0

    def send(self, *events: object, seq: int | None = None) -> None:
        self.seq = self.seq if seq is None else seq
        frames = [b"", self.seq.to_bytes(8, "big"), _wire(*events)]
        self.sock.send_multipart(frames)
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


def _publishing_decode() -> tuple[str, Backend]:
    """A free loopback endpoint and a decode whose events come there."""
    endpoint = _free_endpoint()
    decode = Backend(
        role="decode", url="http://d:1", engine_id="decode0",
        kv_events_endpoint=endpoint,
    )  # fmt: skip
    return endpoint, decode


def _free_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def _counts(metrics: RouterMetrics) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == names.ROUTER_KV_EVENTS.name + "_total"
    }


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(5.0):
        while not check():
            await asyncio.sleep(0.01)


async def test_the_feed_follows_a_decode_and_forgets_it_after_a_gap() -> None:
    endpoint, decode = _publishing_decode()
    prefill = Backend(role="prefill", url="http://p:1", engine_id="prefill0")
    index, metrics = PrefixIndex(100), RouterMetrics("kvpush")
    feed = KvEventFeed((prefill, decode), index, BS, metrics)
    assert feed.engine_ids == ("decode0",)
    feed.start()
    publisher = _Publisher(endpoint)
    ours = block_hashes(TOKENS, BS)
    try:
        # A PUB socket drops what it sends before it is connected: send
        # until the first batch lands (each resent one is a gap, hence lost).
        async with asyncio.timeout(5.0):
            while not index.num_held_blocks("decode0", ours):
                publisher.send(_stored([1, 2, 3, 4], None, TOKENS), seq=0)
                await asyncio.sleep(0.05)
        publisher.send(vllm_events.BlockRemoved([4], medium="GPU"), seq=1)
        await _until(lambda: index.num_held_blocks("decode0", ours) == 3)
        lost_before = _counts(metrics).get("lost", 0.0)
        publisher.send(_stored([9], None, [1, 2, 3, 4]), seq=5)  # 2..4 lost
        await _until(lambda: _counts(metrics).get("lost", 0.0) == lost_before + 1)
        assert index.num_held_blocks("decode0", ours) == 0  # forgotten
        assert index.num_held_blocks("decode0", block_hashes([1, 2, 3, 4], BS)) == 1
        assert _counts(metrics)["removed"] == 1
    finally:
        await feed.close()
        publisher.close()


async def test_an_endpoint_another_router_holds_is_left_and_counted() -> None:
    endpoint, decode = _publishing_decode()
    first_metrics, second_metrics = RouterMetrics("kvpush"), RouterMetrics("kvpush")
    first = KvEventFeed((decode,), PrefixIndex(10), BS, first_metrics)
    second = KvEventFeed((decode,), PrefixIndex(10), BS, second_metrics)
    first.start()
    try:
        await _until(lambda: bool(_bound(endpoint)))
        second.start()
        await _until(lambda: _counts(second_metrics).get("unbound") == 1)
        assert "unbound" not in _counts(first_metrics)
    finally:
        await second.close()
        await first.close()


def _bound(endpoint: str) -> bool:
    """Whether something listens on ``endpoint`` (tcp://127.0.0.1:PORT)."""
    port = int(endpoint.rsplit(":", 1)[1])
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0
