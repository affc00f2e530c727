"""Prefill's pins: the scheduler's own references, in vLLM's block pool, on
every block it hands to the worker in a trigger, dropped once every TP
rank's writer said the push is over. vLLM may preempt a prefill request
whose WRITE is in flight and free its blocks at once; the pins keep them
out of the free queue, so nothing is handed a block a WRITE reads, and the
worker need not hold the forward back (it returns at once:
``test_connector_worker.py``, ``test_connector_writer_safety.py``).

Scripted scheduler of ``test_connector_scheduler.py`` (128-token blocks, a
600-token prompt: 5 blocks), the fake pool of
``tests/fakes/fake_block_pool.py`` (and vLLM's own ``BlockPool`` once).
Every test ends with nothing pinned and no block held.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvpush.connector.connector import KvPushConnector
from kvpush.connector.metadata import PreemptedPush, PushesOver
from kvpush.connector.prefill.scheduler import PENDING_FREE_S, PrefillScheduler
from tests.fakes.fake_block_pool import FakeBlockPool
from tests.fakes.fake_nixl import leftovers
from tests.unit.test_connector_scheduler import (
    BS,
    PREFILL_PARAMS,
    PROMPT,
    FakeRequest,
    admit,
    cached,
    config_for,
    new,
    run_step,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(
    pool: object, clock: Clock, tp_size: int = 1, granularity: str = "request"
) -> PrefillScheduler:
    config = replace(
        config_for("prefill", tp_size=tp_size), push_granularity=granularity
    )
    sched = PrefillScheduler(config, clock=clock)
    sched.bind_block_pool(pool)
    return sched


def over(rid: str, *ranks: int) -> PushesOver:
    return PushesOver({rid: frozenset(ranks)})


def preempt(sched: PrefillScheduler, pool: FakeBlockPool, req, blocks) -> list:
    """vLLM preempts ``req`` in ``schedule()``: frees its blocks, then
    builds the step's metadata."""
    pool.free_request(blocks)
    out = cached(req, None)
    out.preempted_req_ids = {req.request_id}
    return sched.build_connector_meta(out).preempted


def test_a_preempted_requests_pushed_blocks_stay_allocated_until_every_rank_ended():
    """The review's hang: the WRITE is in flight when vLLM preempts."""
    pool, clock = FakeBlockPool(), Clock()
    sched = make(pool, clock, tp_size=2)
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(sched, req)
    blocks = pool.allocate(5)
    assert run_step(sched, req, PROMPT, new(req, blocks)).triggers
    assert pool.refs(blocks) == [2] * 5, "the request's and our pin"
    assert not sched.has_pending_block_frees(), "freeing would return nothing"

    assert preempt(sched, pool, req, blocks) == [PreemptedPush("r2", "t2")]

    assert pool.refs(blocks) == [1] * 5 and not any(map(pool.is_free, blocks))
    assert sched.has_pending_block_frees(), "vLLM should wait for them"
    assert sched.has_pending_push_work(), "keep stepping: the pins must end"
    other = pool.allocate(len(pool.free_queue))  # vLLM hands out all it has
    assert not set(other) & set(blocks), "never a block a WRITE may read"

    sched.update_connector_output(None, None, over("r2", 0))
    assert pool.refs(blocks) == [1] * 5, "rank 1's WRITE may still read them"
    # vLLM recomputes the request in new blocks; they push nothing
    pool.free_request(other[:5])
    req.num_computed_tokens = 0
    again = pool.allocate(5)
    assert run_step(sched, req, PROMPT, cached(req, again, resumed=True)).triggers == []
    assert pool.refs(again) == [1] * 5, "the recompute's blocks are not pinned"

    sched.update_connector_output(None, None, over("r2", 1))

    assert pool.refs(blocks) == [0] * 5 and all(map(pool.is_free, blocks))
    assert [pool.frees[b] for b in blocks] == [2] * 5, "vLLM once, us once"
    assert not sched.has_pending_block_frees()
    assert not sched.has_pending_push_work()
    sched.update_connector_output(None, None, over("r2", 0, 1))  # said again
    assert sched.request_finished(req) == (False, None), "vLLM frees its blocks"
    pool.free_request(again)
    pool.free_request(other[5:])
    assert pool.held() == {}
    assert leftovers(sched) == {}


@pytest.mark.parametrize("meta_first", [True, False], ids=["meta", "sending"])
def test_a_finished_requests_pins_go_once_whichever_report_comes_first(meta_first):
    pool, clock = FakeBlockPool(), Clock()
    sched = make(pool, clock)
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(sched, req)
    blocks = pool.allocate(5)
    run_step(sched, req, PROMPT, new(req, blocks))

    assert sched.request_finished(req) == (True, None), "vLLM keeps them too"
    assert sched.has_pending_block_frees()
    reports = [((None, None, over("r2", 0))), ({"r2"}, None, None)]
    for sending, recving, meta in reports if meta_first else reports[::-1]:
        sched.update_connector_output(sending, recving, meta)
        if sending:
            pool.free_request(blocks)  # vLLM's own free at finished_sending

    assert [pool.frees[b] for b in blocks] == [2] * 5
    assert pool.held() == {}
    assert not sched.has_pending_block_frees() and not sched.has_pending_push_work()
    assert leftovers(sched) == {}


def test_pins_count_as_pending_frees_only_for_a_while_after_their_request_let_go():
    """vLLM waits for pins instead of preempting, but not for ever: a WRITE
    NIXL never ends must not stop the engine from preempting."""
    pool, clock = FakeBlockPool(), Clock()
    sched = make(pool, clock)
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(sched, req)
    blocks = pool.allocate(5)
    run_step(sched, req, PROMPT, new(req, blocks))
    clock.now += 2 * PENDING_FREE_S  # a long-running request: pins not counted
    assert not sched.has_pending_block_frees()

    preempt(sched, pool, req, blocks)
    clock.now += PENDING_FREE_S - 0.001
    assert sched.has_pending_block_frees()
    clock.now += 0.001
    assert not sched.has_pending_block_frees(), "vLLM may preempt again"
    assert pool.refs(blocks) == [1] * 5, "but the blocks stay pinned"
    assert sched.has_pending_push_work()

    sched.update_connector_output(None, None, over("r2", 0))
    assert sched.request_finished(req) == (False, None)
    assert pool.held() == {}
    assert leftovers(sched) == {}


def test_chunks_triggered_after_every_rank_ended_the_push_are_not_pinned():
    """Streamed: a push that ended mid-stream (e.g. decode cancelled it)
    drops the chunks that still come; nothing would free their pins."""
    pool, clock = FakeBlockPool(), Clock()
    sched = make(pool, clock, granularity="chunk")
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(sched, req)
    first = pool.allocate(2)
    assert run_step(sched, req, 2 * BS, new(req, first)).triggers
    assert pool.refs(first) == [2, 2]

    sched.update_connector_output(None, None, over("r2", 0))
    assert pool.refs(first) == [1, 1]
    rest = pool.allocate(3)
    assert run_step(sched, req, PROMPT - 2 * BS, cached(req, rest)).triggers
    assert pool.refs(rest) == [1, 1, 1], "a chunk no writer will read"

    assert sched.request_finished(req) == (True, None)
    sched.update_connector_output({"r2"}, None, None)
    pool.free_request(first + rest)
    assert pool.held() == {}
    assert leftovers(sched) == {}


def test_vllms_block_pool_hands_out_no_pinned_block_of_a_preempted_request():
    """The same with vLLM's own BlockPool: a preempted request's pinned
    blocks do not count as free, and come back when the pins go."""
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS)
    sched = make(pool, Clock())
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(sched, req)
    blocks = [b.block_id for b in pool.get_new_blocks(5)]
    run_step(sched, req, PROMPT, new(req, blocks))

    pool.free_blocks([pool.blocks[b] for b in blocks])  # vLLM preempts it
    out = cached(req, None)
    out.preempted_req_ids = {"r2"}
    sched.build_connector_meta(out)

    assert pool.get_num_free_blocks() == 2, "7 usable blocks, 5 pinned"
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    sched.update_connector_output(None, None, over("r2", 0))
    assert pool.get_num_free_blocks() == 7
    assert sched.request_finished(req) == (False, None)
    assert leftovers(sched) == {}


def test_vllm_merges_every_ranks_pushes_over_of_one_step():
    """vLLM's KVOutputAggregator merges the ranks' worker metas with
    ``PushesOver.aggregate``; one rank's silence is kept apart."""

    def output(meta: PushesOver | None) -> ModelRunnerOutput:
        kv = KVConnectorOutput(kv_connector_worker_meta=meta)
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv)

    aggregator = KVOutputAggregator(expected_finished_count=3)
    merged = aggregator.aggregate(
        [
            output(over("a", 0)),
            output(None),
            output(PushesOver({"a": frozenset({2}), "b": frozenset({2})})),
        ]
    )

    assert merged is not None and merged.kv_connector_output is not None
    assert merged.kv_connector_output.kv_connector_worker_meta == PushesOver(
        {"a": frozenset({0, 2}), "b": frozenset({2})}
    )


def test_the_connector_hands_vllms_hooks_to_the_prefill_scheduler():
    """``bind_gpu_block_pool``, ``has_pending_block_frees`` and the worker
    meta in ``update_connector_output`` reach :class:`PrefillScheduler`."""
    pool, clock = FakeBlockPool(), Clock()
    config = replace(config_for("prefill"), push_granularity="request")
    conn = object.__new__(KvPushConnector)  # vLLM's config is not needed here
    conn._prefill = PrefillScheduler(config, clock=clock)
    conn._decode = conn._prefill_worker = conn._decode_worker = None
    conn.bind_gpu_block_pool(pool)
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(conn._prefill, req)
    blocks = pool.allocate(5)
    run_step(conn._prefill, req, PROMPT, new(req, blocks))

    assert conn.request_finished(req, blocks) == (True, None)
    assert conn.has_pending_block_frees()
    conn.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=over("r2", 0))
    )
    assert not conn.has_pending_block_frees()
    assert pool.refs(blocks) == [1] * 5, "vLLM's, until finished_sending"
    conn.update_connector_output(KVConnectorOutput(finished_sending={"r2"}))
    pool.free_request(blocks)
    assert pool.held() == {}
    assert leftovers(conn._prefill) == {}
