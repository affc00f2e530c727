"""Concurrent requests sharing a prefix: no block reaches the writer before
a forward that wrote it has completed.

vLLM caches a request's full blocks when it allocates them, before the
forward that computes them. So in one ``schedule()`` request A can
allocate (and cache) the prefix's blocks and request B, admitted later in
the same call, can hit them: B's "cached" blocks are filled by A's forward
of this very step. Handed to the writer before that forward, they would
be written to decode while still being filled (silent corruption seen on
a real cluster with the default ``auto`` granularity).

Each test runs one engine step through prefill's scheduler side and worker
side (the scripted scheduler of ``test_connector_scheduler.py``, the
recording writer of ``test_connector_worker.py``) and checks what the
writer could count as written before, during and after the forward.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpush.connector.metadata import PrefillMetadata
from kvpush.connector.prefill.fence import LayerFences
from kvpush.connector.prefill.scheduler import PrefillScheduler
from kvpush.connector.prefill.worker import PrefillWorker
from kvpush.transfer.groups import flat, one
from kvpush.transfer.messages import PrefillLeg
from tests.unit.test_connector_layer_sides import NAME_0, worker_for
from tests.unit.test_connector_scheduler import (
    CachedReqs,
    FakeRequest,
    NewReq,
    SchedulerOutput,
    admit,
    config_for,
)
from tests.unit.test_connector_worker import RecordingWriter

SHARED = (1, 2)  # the prefix's two blocks: A allocates them, B hits them


def leg(tid: str) -> dict:
    return PrefillLeg(transfer_id=tid, decode_engine_id="d0").to_dict()


def one_step_sharing_a_prefix(granularity: str) -> PrefillMetadata:
    """A (new, chunked: its first 256 tokens) and B (new, its 2-block prefix
    hit on A's blocks, chunked too: its next 256 tokens) in one step of
    600-token prompts; the metadata the worker gets for that step."""
    sched = PrefillScheduler(
        replace(config_for("prefill"), push_granularity=granularity)
    )
    a = FakeRequest("a", leg("ta"))
    b = FakeRequest("b", leg("tb"), num_computed_tokens=256)
    admit(sched, a)
    admit(sched, b)
    out = SchedulerOutput(
        scheduled_new_reqs=[
            NewReq("a", ([*SHARED, 3, 4, 5],), 0),
            NewReq("b", ([*SHARED, 6, 7, 8],), 256),
        ],
        scheduled_cached_reqs=CachedReqs(),
        num_scheduled_tokens={"a": 256, "b": 256},
    )
    meta = sched.build_connector_meta(out)
    sched.close()
    return meta


def counted_written(writer: RecordingWriter) -> set[tuple[str, int]]:
    """(transfer, source block) the writer may send now: chunks marked
    computed, and the written layers of chunks handed over per layer."""
    done = {(r.transfer_id, b) for r in writer.computed for b in flat(r.src_block_ids)}
    for ready, _, fence in writer.ready:
        if isinstance(fence, LayerFences) and fence.num_ready() > 0:
            done |= {(ready.transfer_id, b) for b in flat(ready.src_block_ids)}
    return done


@pytest.mark.parametrize("granularity", ["auto", "chunk", "layer"])
def test_a_prefix_hit_on_blocks_this_step_fills_waits_for_its_forward(granularity):
    meta = one_step_sharing_a_prefix(granularity)
    worker, writer = worker_for(granularity)
    try:
        worker.bind(meta)
        assert counted_written(writer) == set(), (
            "nothing counts as written before the forward: B's hit blocks "
            "are still being filled by A's"
        )

        worker.save_kv_layer(NAME_0)  # layer 0's attention wrote A's and B's KV
        worker.wait_for_save()  # the forward is over

        b_blocks = {b for tid, b in counted_written(writer) if tid == "tb"}
        assert set(SHARED) <= b_blocks, "B's hit blocks go once the forward ran"
    finally:
        worker.close()


def test_b_hit_blocks_are_part_of_its_first_chunk_not_a_trigger_of_their_own():
    meta = one_step_sharing_a_prefix("chunk")
    b = [t for t in meta.triggers if t.transfer_id == "tb"]
    assert [(t.first_block, t.src_block_ids, t.final) for t in b] == [
        (0, one((*SHARED, 6, 7)), False)
    ]


def test_whole_request_pushes_trigger_nothing_before_the_last_chunk():
    assert one_step_sharing_a_prefix("request").triggers == []


def test_the_worker_hands_nothing_over_as_written_before_the_forward():
    # whatever the scheduler sends: the worker's bind never marks KV ready
    worker: PrefillWorker
    for granularity in ("chunk", "layer"):
        meta = one_step_sharing_a_prefix(granularity)
        worker, writer = worker_for(granularity)
        try:
            worker.bind(meta)
            assert writer.computed == [], granularity
            assert all(
                isinstance(f, LayerFences) and f.num_ready() == 0
                for _, _, f in writer.ready
            ), granularity
        finally:
            worker.close()
