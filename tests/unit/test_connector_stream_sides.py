"""Streaming push on prefill's scheduler and worker sides
(``push_granularity`` ``chunk``): which blocks each engine step completed,
and when the worker hands them to the writer.

The scheduler builds a step's metadata before vLLM advances
``num_computed_tokens``: after the step's forward the first ``computed +
scheduled`` tokens hold KV, so the blocks they fill are complete (the last
block once the whole prompt is). Blocks prefill's own prefix cache held at
admission go with the first chunk (see ``test_connector_shared_prefix.py``).
Uses the scripted scheduler of ``test_connector_scheduler.py``
(128-token blocks, a 600-token prompt: 5 blocks) and the recording writer
of ``test_connector_worker.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from kvpush.connector.metadata import PreemptedPush, PushesOver, PushTrigger
from kvpush.connector.prefill.scheduler import PrefillScheduler
from kvpush.transfer.groups import one
from tests.fakes.fake_nixl import leftovers
from tests.unit.test_connector_scheduler import (
    PREFILL_PARAMS,
    FakeRequest,
    admit,
    cached,
    config_for,
    empty_step,
    new,
    run_step,
)


@pytest.fixture
def streamed() -> Iterator[PrefillScheduler]:
    config = replace(config_for("prefill"), push_granularity="chunk")
    sched = PrefillScheduler(config)
    yield sched
    sched.close()


def chunk(
    first: int, blocks: tuple[int, ...], final: bool = False, **kw
) -> PushTrigger:
    return PushTrigger(
        req_id="r2",
        transfer_id="t2",
        src_block_ids=one(blocks),
        num_tokens=600,
        decode_engine_id="d0",
        first_block=first,
        final=final,
        **kw,
    )


def test_each_step_triggers_the_blocks_its_chunk_completed(streamed):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(streamed, req)

    step1 = run_step(streamed, req, 256, new(req, [1, 2]))  # tokens 0..255
    step2 = run_step(streamed, req, 256, cached(req, [3, 4]))  # 256..511
    last = run_step(streamed, req, 88, cached(req, [5, 6]))  # 512..599
    after = run_step(streamed, req, 1, cached(req, [7]))  # first output token

    assert step1.triggers == [chunk(0, (1, 2))]
    assert step2.triggers == [chunk(2, (3, 4))]
    assert last.triggers == [chunk(4, (5,), final=True)]
    assert after.triggers == [], "the last chunk triggers once"


def test_a_block_is_triggered_only_once_the_chunk_filling_it_ran(streamed):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(streamed, req)

    step1 = run_step(streamed, req, 200, new(req, [1, 2]))  # block 1 half full
    step2 = run_step(streamed, req, 200, cached(req, [3, 4]))  # 400: 3 complete
    last = run_step(streamed, req, 200, cached(req, [5]))

    assert step1.triggers == [chunk(0, (1,))]
    assert step2.triggers == [chunk(1, (2, 3))]
    assert last.triggers == [chunk(3, (4, 5), final=True)]


def test_prefills_own_prefix_hits_go_with_the_first_chunk(streamed):
    # a hit may be a block another request's forward of this step still
    # fills: it is pushed after this step's forward, with the chunk
    req = FakeRequest("r2", PREFILL_PARAMS, num_computed_tokens=256)  # 2 blocks hit
    admit(streamed, req)

    step1 = run_step(streamed, req, 256, new(req, [8, 9, 1, 2]))

    assert step1.triggers == [chunk(0, (8, 9, 1, 2))]


def test_a_request_aborted_between_two_chunks_keeps_its_blocks_and_cancels(
    streamed,
):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(streamed, req)
    run_step(streamed, req, 256, new(req, [1, 2]))

    assert streamed.request_finished(req) == (True, None), "a WRITE may read them"
    assert empty_step(streamed).cancels == ["t2"]
    assert streamed.counters.get("aborted.mid_stream") == 1
    streamed.update_connector_output(finished_sending={"r2"}, finished_recving=None)
    assert not streamed.has_pending_push_work()
    assert leftovers(streamed) == {}


def test_a_preemption_mid_stream_closes_the_push_and_triggers_nothing_more(
    streamed,
):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(streamed, req)
    run_step(streamed, req, 256, new(req, [1, 2]))

    out = cached(req, None)
    out.preempted_req_ids = {"r2"}
    assert streamed.build_connector_meta(out).preempted == [PreemptedPush("r2", "t2")]
    req.num_computed_tokens = 0  # vLLM recomputes it
    again = run_step(streamed, req, 600, cached(req, [7, 8, 9, 10, 11], True))

    assert again.triggers == [], "its transfer is closed"
    assert streamed.request_finished(req) == (False, None), "vLLM frees its blocks"
    assert streamed.has_pending_push_work(), "its first chunk stays pinned"
    streamed.update_connector_output(None, None, PushesOver({"r2": frozenset({0})}))
    assert leftovers(streamed) == {}


def test_request_granularity_triggers_once_with_every_block(prefill):
    req = FakeRequest("r2", PREFILL_PARAMS, num_computed_tokens=256)
    admit(prefill, req)

    step1 = run_step(prefill, req, 256, new(req, [8, 9, 1, 2]))
    last = run_step(prefill, req, 88, cached(req, [3]))

    assert step1.triggers == []
    assert last.triggers == [chunk(0, (8, 9, 1, 2, 3), final=True)]


@pytest.fixture
def prefill() -> Iterator[PrefillScheduler]:
    # whole-request pushes (the default, auto, streams: see the stream tests)
    sched = PrefillScheduler(replace(config_for("prefill"), push_granularity="request"))
    yield sched
    sched.close()


@pytest.mark.parametrize(
    ("name", "streams"),
    [("request", False), ("chunk", True), ("layer", True), ("auto", True)],
)
def test_push_granularity_is_read_from_the_extra_config(name, streams):
    config = replace(config_for("prefill"), push_granularity=name)
    assert config.streams is streams


@pytest.mark.parametrize("name", ["x", "layers", ""])
def test_push_granularity_refuses_what_kvpush_cannot_do(name):
    with pytest.raises(ValueError, match="one of auto, request, chunk, layer"):
        replace(config_for("prefill"), push_granularity=name)


def test_the_default_push_granularity_is_auto():
    # streaming is the default: per layer where a chunk is large, else per chunk
    config = config_for("prefill")
    assert config.push_granularity == "auto" and config.streams
    assert config.may_push_per_layer
