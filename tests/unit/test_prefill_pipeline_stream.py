"""The prefill writer's state machine, driven directly (no thread, no
sleeps; :mod:`tests.unit.prefill_pipeline_rig`): streaming per chunk and
per layer, late binding, tensor parallelism and reconciling with a decode
that reconnected.

A streamed transfer stays *in flight* from its first WRITE to its last:
more WRITEs follow as chunks (or layers of a chunk) are written, the Done
rides on the last one and is posted only once every earlier WRITE ended.
"""

from __future__ import annotations

from kvpush.connector.prefill.fence import ALL_LAYERS, NO_FENCE, LayerFences
from kvpush.connector.prefill.transfer import Phase
from kvpush.transfer.matcher import PREFILL_CLAIM_PREFIX
from kvpush.transfer.messages import Cause, Done
from tests.fakes.fake_nixl import leftovers
from tests.unit.prefill_pipeline_rig import (
    DST,
    FOREVER,
    REG_ROUTE,
    SRC,
    TOKEN,
    FixedFaults,
    PipelineRig,
    blocks_of,
    end_write,
)
from tests.unit.test_connector_writer import PREFILL

DONE = Done("t1", PREFILL, num_blocks=4)
NEW_ROUTE = b"route-d0-after"  # a socket decode reconnected on


def both(src: list[int], dst: list[int]) -> dict[int, tuple[list[int], list[int]]]:
    """What a WRITE of both layers of these blocks copies."""
    return {0: (src, dst), 1: (src, dst)}


def streaming(rig: PipelineRig) -> PipelineRig:
    """Decode said Hello and registered t1."""
    rig.hello(0.0)
    rig.register(0.0)
    return rig


# -- per chunk ---------------------------------------------------------------------


def test_each_chunk_is_pushed_as_it_comes_and_done_rides_on_the_last():
    rig = streaming(PipelineRig())
    rig.ready(0.0, src=(4, 5), final=False)
    rig.tick(0.0)
    assert rig.phase() is Phase.IN_FLIGHT, "between chunks: more WRITEs follow"
    (first,) = rig.writes()
    assert blocks_of(first) == both([4, 5], [10, 11]) and first.notif == b""

    rig.ready(1.0, src=(6, 9), first=2)
    rig.tick(1.0)

    _, last = rig.writes()
    assert blocks_of(last) == both([6, 9], [12, 13])
    assert last.message == DONE
    assert rig.notifications() == [DONE]
    assert rig.finished == ["req-1"] and rig.failures() == []
    rig.assert_nothing_held()


def test_the_done_piece_waits_for_every_earlier_write():
    rig = streaming(PipelineRig())
    rig.io.script_polls(*FOREVER)
    rig.ready(0.0, src=(4, 5), final=False)
    rig.tick(0.0)
    rig.ready(0.1, src=(6, 9), first=2)
    rig.tick(0.1)

    first, rest = rig.writes()
    assert blocks_of(rest) == both([6], [12]), "less its Done piece"
    assert rest.notif == b""
    end_write(first)
    rig.tick(0.2)
    assert len(rig.writes()) == 2, "one earlier WRITE still runs"

    end_write(rest)
    rig.tick(0.3)  # both ended: the Done piece is due
    rig.tick(0.4)  # posted
    *_, done = rig.writes()
    assert blocks_of(done) == both([9], [13])
    assert done.running_at_post == 0 and done.message == DONE
    assert rig.finished == []
    end_write(done)
    rig.tick(0.5)
    assert rig.finished == ["req-1"]
    rig.assert_nothing_held()


def test_a_registration_mid_stream_catches_up_in_one_coalesced_write():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.ready(0.0, src=(4, 5), final=False)
    rig.ready(0.1, src=(6,), first=2, final=False)
    rig.tick(0.1)
    assert rig.phase() is Phase.WAITING and rig.writes() == []

    rig.register(0.2)
    rig.tick(0.2)
    (write,) = rig.writes()
    assert blocks_of(write) == both([4, 5, 6], [10, 11, 12])
    assert len(write.src) == 2, "one run per layer"

    rig.ready(0.3, src=(9,), first=3)
    rig.tick(0.3)
    assert blocks_of(rig.writes()[-1]) == both([9], [13])
    assert rig.finished == ["req-1"]
    rig.assert_nothing_held()


def test_a_first_chunk_inside_decodes_prefix_hit_posts_nothing():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0, dst=(21, 22), first_block=2)
    rig.ready(0.0, src=(4, 5), final=False)
    rig.tick(0.0)
    assert rig.phase() is Phase.MATCHED and rig.writes() == []

    rig.ready(0.1, src=(6, 9), first=2)
    rig.tick(0.1)
    (write,) = rig.writes()
    assert blocks_of(write) == both([6, 9], [21, 22])
    assert rig.finished == ["req-1"]
    rig.assert_nothing_held()


def test_a_cancel_between_two_chunks_posts_nothing_more():
    rig = streaming(PipelineRig())
    rig.ready(0.0, src=(4, 5), final=False)
    rig.tick(0.0)
    rig.cancel(0.1)
    assert rig.phase() is None, "no WRITE in flight: ended at once"
    assert rig.failures() == [("t1", Cause.CANCELLED)]
    assert rig.finished == ["req-1"]

    rig.ready(0.2, src=(6, 9), first=2)  # the next chunk's forward ended
    rig.tick(0.2)
    assert len(rig.writes()) == 1
    assert rig.finished == ["req-1"], "a later chunk of it is dropped"
    assert rig.notifications() == []
    rig.assert_nothing_held()


def test_a_preemption_mid_stream_lets_the_write_in_flight_finish():
    rig = streaming(PipelineRig())
    rig.io.script_polls(*FOREVER)
    rig.ready(0.0, src=(4, 5), final=False)
    rig.tick(0.0)
    rig.pipeline.on_preempt({"t1"}, 0.1)
    assert rig.phase() is Phase.ENDING and rig.finished == []
    rig.ready(0.2, src=(6, 9), first=2)  # the forward had already run
    rig.tick(0.2)
    assert len(rig.writes()) == 1, "nothing posted after the preemption"

    end_write(rig.writes()[0])
    rig.tick(0.3)
    assert rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.PREEMPTED)]
    rig.assert_nothing_held()


def test_a_failed_chunk_ends_the_stream():
    rig = streaming(PipelineRig())
    rig.io.script_polls("PROC", "ERR")
    rig.ready(0.0, src=(4, 5), final=False)
    rig.tick(0.0)
    rig.tick(0.1)
    assert rig.failures() == [("t1", Cause.WRITE_FAILED)]
    assert rig.finished == ["req-1"]

    rig.ready(0.2, src=(6, 9), first=2)
    rig.tick(0.2)
    assert len(rig.writes()) == 1 and rig.finished == ["req-1"]
    rig.assert_nothing_held()


def test_a_chunk_out_of_order_closes_the_transfer():
    rig = streaming(PipelineRig())
    rig.ready(0.0, src=(4,), final=False)
    rig.tick(0.0)
    rig.ready(0.1, src=(6, 9), first=2)  # block 1 skipped: a bug upstream

    assert rig.counters.get("rejected.invalid") == 1
    assert rig.failures() == [("t1", Cause.REJECTED)]
    assert rig.finished == ["req-1"] and rig.notifications() == []
    rig.assert_nothing_held()


def test_the_post_delay_holds_a_chunk_due_only_after_the_match():
    rig = PipelineRig(faults=FixedFaults(post_delay_s=1.0))
    rig.hello(0.0)
    rig.register(0.0, dst=(21, 22), first_block=2)
    rig.ready(0.0, src=(4, 5), final=False)  # matched, nothing due
    rig.ready(0.5, src=(6, 9), first=2)
    rig.tick(0.5)
    assert rig.phase() is Phase.MATCHED and rig.writes() == []

    rig.tick(1.0)
    (write,) = rig.writes()
    assert blocks_of(write) == both([6, 9], [21, 22])
    rig.assert_nothing_held()


# -- per layer ---------------------------------------------------------------------

LAYERS = 4


def layers(src: list[int], dst: list[int], *ls: int) -> dict:
    return {layer: (src, dst) for layer in ls}


def test_each_layer_goes_as_soon_as_it_is_written():
    rig = streaming(PipelineRig(num_layers=LAYERS))
    fences = LayerFences(LAYERS)
    rig.ready(0.0, src=(4, 5), fence=fences, final=False)
    rig.tick(0.0)
    assert rig.writes() == [], "no layer written yet"

    for layer in range(LAYERS):
        rig.pipeline.on_layer_saved(fences, layer, NO_FENCE)
        rig.tick(0.1 * (layer + 1))
        assert blocks_of(rig.writes()[-1]) == layers([4, 5], [10, 11], layer)
    rig.pipeline.on_layer_saved(fences, ALL_LAYERS, NO_FENCE)
    last = LayerFences(LAYERS)
    rig.ready(1.0, src=(6, 9), fence=last, first=2)
    rig.pipeline.on_layer_saved(last, ALL_LAYERS, NO_FENCE)  # the forward ended
    rig.tick(1.0)

    assert blocks_of(rig.writes()[-1]) == layers([6, 9], [12, 13], 0, 1, 2, 3)
    assert [w.notif for w in rig.writes()[:-1]] == [b""] * LAYERS
    assert rig.notifications() == [DONE]
    assert rig.finished == ["req-1"]
    rig.assert_nothing_held()


def test_a_cancel_between_two_layers_posts_nothing_more():
    rig = streaming(PipelineRig(num_layers=LAYERS))
    rig.io.script_polls(*FOREVER)
    fences = LayerFences(LAYERS)
    rig.ready(0.0, fence=fences)
    rig.pipeline.on_layer_saved(fences, 0, NO_FENCE)
    rig.tick(0.0)
    (write,) = rig.writes()

    rig.cancel(0.1)
    rig.pipeline.on_layer_saved(fences, ALL_LAYERS, NO_FENCE)  # the forward goes on
    rig.tick(0.1)
    assert rig.phase() is Phase.ENDING
    assert len(rig.writes()) == 1 and rig.failures() == []

    end_write(write)
    rig.tick(0.2)
    assert rig.failures() == [("t1", Cause.CANCELLED)]
    assert rig.finished == ["req-1"] and rig.notifications() == []
    rig.assert_nothing_held()


def test_a_layer_never_saved_goes_when_the_forward_ends():
    rig = streaming(PipelineRig(num_layers=LAYERS))
    fences = LayerFences(LAYERS)
    rig.ready(0.0, fence=fences)
    rig.pipeline.on_layer_saved(fences, 0, NO_FENCE)
    rig.pipeline.on_layer_saved(fences, 2, NO_FENCE)  # 1 never reported
    rig.tick(0.0)
    assert [blocks_of(w) for w in rig.writes()] == [layers(list(SRC), list(DST), 0)], (
        "layer 2 waits for layer 1"
    )

    rig.pipeline.on_layer_saved(fences, ALL_LAYERS, NO_FENCE)
    rig.tick(0.1)
    assert rig.finished == ["req-1"] and rig.notifications() == [DONE]
    rig.assert_nothing_held()


# -- late binding -------------------------------------------------------------------


def claimable(rig: PipelineRig) -> PipelineRig:
    """Decodes d0 and d1 said Hello."""
    rig.hello(0.0)
    rig.hello(0.0, engine="d1")
    return rig


def test_the_right_token_from_any_decode_writes_the_ready_kv_at_once():
    rig = claimable(PipelineRig())
    rig.ready(0.0, late=True)
    rig.tick(0.0)
    assert rig.phase() is Phase.WAITING

    rig.register(0.1, engine="d1", route=b"route-d1-sched", token=TOKEN)
    assert rig.phase() is Phase.MATCHED
    rig.tick(0.1)

    (write,) = rig.writes()
    assert write.peer == "kvpush-d1"
    assert rig.notifications(engine="d1") == [DONE]
    assert rig.notifications() == [], "d0 was not written to"
    assert rig.finished == ["req-1"] and rig.failures() == []
    rig.assert_nothing_held()


def test_a_claim_before_the_late_kv_waits_in_the_matcher_then_writes():
    rig = claimable(PipelineRig())
    rig.register(0.0, engine="d1", route=b"route-d1-sched", token=TOKEN)
    assert rig.phase() is None, "a registration alone is the matcher's"

    rig.ready(0.1, late=True)
    assert rig.phase() is Phase.MATCHED
    rig.tick(0.1)

    (write,) = rig.writes()
    assert write.peer == "kvpush-d1"
    assert rig.notifications(engine="d1") == [DONE]
    assert rig.finished == ["req-1"]
    rig.assert_nothing_held()


def test_a_prefill_drawn_claim_with_no_kv_here_is_refused_at_once():
    """A claim of the form prefill draws reaches a decode only after its KV
    is in: a registration with one that matches nothing here is forged (or
    another prefill's) and fails at once; nothing is held, nothing written."""
    rig = claimable(PipelineRig())
    forged = PREFILL_CLAIM_PREFIX + "f" * 43

    rig.register(0.0, engine="d1", route=b"route-d1-sched", token=forged)

    assert rig.failures(b"route-d1-sched") == [("t1", Cause.REJECTED)]
    assert rig.counters.get("rejected.unknown_claim") == 1
    assert leftovers(rig.pipeline._matcher) == {}, "not even a tombstone"
    rig.tick(100.0)
    assert rig.writes() == [] and len(rig.failures()) == 1
    rig.assert_nothing_held()


def test_a_prefill_drawn_claim_claims_the_kv_it_was_drawn_for():
    rig = claimable(PipelineRig())
    claim = PREFILL_CLAIM_PREFIX + "c" * 43
    rig.ready(0.0, late=True, token=claim)

    rig.register(0.1, engine="d1", route=b"route-d1-sched", token=claim)
    rig.tick(0.1)

    (write,) = rig.writes()
    assert write.peer == "kvpush-d1" and rig.notifications(engine="d1") == [DONE]
    assert rig.finished == ["req-1"] and rig.failures() == []
    rig.assert_nothing_held()


def test_a_wrong_token_frees_the_kv_and_tells_that_decode():
    rig = claimable(PipelineRig())
    rig.ready(0.0, late=True)
    rig.register(0.1, engine="d1", route=b"route-d1-sched", token="wrong")

    assert rig.finished == ["req-1"]
    assert rig.failures(b"route-d1-sched") == [("t1", Cause.REJECTED)]
    assert rig.counters.get("rejected.mismatch") == 1
    rig.register(0.2, engine="d1", route=b"route-d1-sched", token=TOKEN)
    assert len(rig.failures(b"route-d1-sched")) == 2, "closed: too late"
    rig.tick(0.2)
    assert rig.writes() == []
    rig.assert_nothing_held()


def test_claimed_once_a_second_decode_is_told_and_the_first_write_goes_on():
    rig = claimable(PipelineRig())
    rig.io.script_polls(*FOREVER)
    rig.ready(0.0, late=True)
    rig.register(0.0, engine="d1", route=b"route-d1-sched", token=TOKEN)
    rig.tick(0.0)

    rig.register(0.1, token=TOKEN)  # d0 holds the token too
    assert rig.failures(REG_ROUTE) == [("t1", Cause.REJECTED)]
    assert rig.counters.get("rejected.claimed") == 1
    assert rig.phase() is Phase.IN_FLIGHT

    end_write(rig.writes()[0])
    rig.tick(0.2)
    assert rig.finished == ["req-1"]
    assert rig.notifications(engine="d1") == [DONE]
    assert rig.failures(b"route-d1-sched") == []
    rig.assert_nothing_held()


def test_an_unclaimed_late_kv_expires_with_nobody_to_tell():
    rig = claimable(PipelineRig(ready_ttl_s=5.0))
    rig.ready(0.0, late=True)
    rig.tick(5.0)

    assert rig.finished == ["req-1"]
    assert rig.counters.get("expired.ready") == 1
    assert rig.failures() == [] and rig.counters.get("failed.unroutable") == 0
    rig.assert_nothing_held()


def test_a_late_stream_claimed_mid_way_pushes_the_rest_to_its_claimer():
    rig = claimable(PipelineRig())
    rig.ready(0.0, src=(4, 5), final=False, late=True)
    rig.register(0.1, engine="d1", route=b"route-d1-sched", token=TOKEN)
    rig.tick(0.1)
    rig.ready(0.2, src=(6, 9), first=2, late=True)
    rig.tick(0.2)

    assert [blocks_of(w) for w in rig.writes()] == [
        both([4, 5], [10, 11]),
        both([6, 9], [12, 13]),
    ]
    assert all(w.peer == "kvpush-d1" for w in rig.writes())
    assert rig.notifications(engine="d1") == [DONE]
    rig.assert_nothing_held()


def test_a_late_claim_catches_up_on_the_layers_already_written():
    rig = claimable(PipelineRig())
    rig.ready(0.0, src=(4, 5), final=False, late=True)
    fences = LayerFences(2)
    rig.ready(0.0, src=(6,), first=2, fence=fences, final=False, late=True)
    rig.pipeline.on_layer_saved(fences, 0, NO_FENCE)
    rig.tick(0.0)
    assert rig.writes() == [], "no decode claimed it yet"

    rig.register(0.1, engine="d1", route=b"route-d1-sched", token=TOKEN)
    rig.tick(0.1)
    (write,) = rig.writes()
    assert blocks_of(write) == {0: ([4, 5, 6], [10, 11, 12]), 1: ([4, 5], [10, 11])}

    rig.pipeline.on_layer_saved(fences, 1, NO_FENCE)
    rig.ready(0.2, src=(9,), first=3, late=True)
    rig.tick(0.2)
    assert rig.notifications(engine="d1") == [DONE]
    assert rig.finished == ["req-1"]
    rig.assert_nothing_held()


# -- tensor parallelism ---------------------------------------------------------------


def test_prefill_tp1_writes_each_decode_rank_its_heads_and_ends_on_both_dones():
    rig = PipelineRig(decode_tp=2, total_kv_heads=2)
    rig.io.script_polls(*FOREVER)
    rig.hellos(0.0)
    rig.register(0.0)
    rig.ready(0.0)
    rig.tick(0.0)

    first, second = rig.writes()
    assert {first.peer, second.peer} == {"kvpush-d0-rank0", "kvpush-d0-rank1"}
    end_write(first)
    rig.tick(0.1)
    assert rig.phase() is Phase.IN_FLIGHT and rig.finished == [], "one Done of two"

    end_write(second)
    rig.tick(0.2)
    assert rig.finished == ["req-1"]
    assert rig.notifications(rank=0) == [DONE] and rig.notifications(rank=1) == [DONE]
    rig.assert_nothing_held()


def test_prefill_tp2_ranks_each_write_their_heads_to_decode_tp1():
    for rank in (0, 1):
        rig = PipelineRig(tp_size=2, rank=rank, decode_tp=1, total_kv_heads=2)
        assert rig.hello(0.0).accepted
        rig.register(0.0)
        rig.ready(0.0)
        rig.tick(0.0)

        (write,) = rig.writes()
        assert write.message == Done("t1", PREFILL, num_blocks=4, rank=rank)
        assert rig.finished == ["req-1"]
        rig.assert_nothing_held()


def test_a_rank_that_writes_nothing_frees_the_kv_at_once():
    # prefill TP 2, decode TP 1, one KV head: rank 1 holds a replica
    rig = PipelineRig(tp_size=2, rank=1, decode_tp=1, total_kv_heads=1)
    rig.register(0.0)
    assert rig.counters.get("idle_rank") == 1
    assert rig.replies.sent == [], "decode waits for no word from it"

    rig.ready(0.1)
    assert rig.phase() is None and rig.finished == ["req-1"]
    assert rig.writes() == []
    rig.assert_nothing_held()


def test_an_idle_ranks_kv_in_before_its_registration_is_freed_by_it():
    rig = PipelineRig(tp_size=2, rank=1, decode_tp=1, total_kv_heads=1)
    rig.ready(0.0)
    assert rig.phase() is Phase.WAITING
    rig.register(0.1)
    assert rig.finished == ["req-1"] and rig.replies.sent == []
    rig.assert_nothing_held()


# -- reconcile -------------------------------------------------------------------------


def test_reconcile_of_an_id_never_seen_fails_it_and_refuses_it_after():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.reconcile(0.0, NEW_ROUTE)
    assert rig.failures(NEW_ROUTE) == [("t1", Cause.PEER_LOST)]
    assert rig.counters.get("reconciled.ended") == 1

    rig.register(0.1)
    rig.ready(0.1)
    rig.tick(0.1)
    assert rig.finished == ["req-1"] and rig.writes() == []
    rig.assert_nothing_held()


def test_reconcile_of_a_held_transfer_sends_its_word_to_the_new_socket():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0)
    rig.reconcile(0.1, NEW_ROUTE)
    assert rig.counters.get("reconciled.live") == 1
    assert rig.failures() == [], "held: no answer yet"

    rig.pipeline.on_prefill_cancel("t1", 0.2)
    assert rig.failures() == [("t1", Cause.CANCELLED)]
    assert rig.failures(NEW_ROUTE) == [("t1", Cause.CANCELLED)]
    rig.assert_nothing_held()


def test_reconcile_mid_stream_keeps_the_transfer_going():
    rig = streaming(PipelineRig())
    rig.ready(0.0, src=(4, 5), final=False)
    rig.tick(0.0)
    rig.reconcile(0.1, NEW_ROUTE)
    assert rig.counters.get("reconciled.live") == 1

    rig.ready(0.2, src=(6, 9), first=2)
    rig.tick(0.2)
    assert rig.finished == ["req-1"] and rig.failures() == []
    assert len(rig.writes()) == 2
    rig.assert_nothing_held()


def test_reconcile_after_the_done_says_the_done_again_to_its_decode_only():
    rig = streaming(PipelineRig())
    rig.ready(0.0)
    rig.tick(0.0)
    rig.reconcile(1.0, NEW_ROUTE)
    rig.reconcile(1.0, b"route-d9", engine="d9")

    assert rig.sent_to(NEW_ROUTE) == [DONE]
    assert rig.failures(b"route-d9") == [("t1", Cause.PEER_LOST)]
    rig.assert_nothing_held()


# -- more streaming, late binding and reconcile ---------------------------------


class Pending:
    """A forward that has not completed."""

    def is_ready(self) -> bool:
        return False


def test_a_partial_prefix_hit_on_decode_streams_only_the_blocks_it_lacks():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0, dst=(20, 21, 22), first_block=1)  # decode holds block 0
    rig.ready(0.0, src=(4, 5), final=False)
    rig.tick(0.0)
    rig.ready(0.1, src=(6, 9), first=2)
    rig.tick(0.1)

    assert [blocks_of(w) for w in rig.writes()] == [
        both([5], [20]),
        both([6, 9], [21, 22]),
    ]
    assert rig.notifications() == [Done("t1", PREFILL, num_blocks=3)]
    rig.assert_nothing_held()


def test_a_written_chunk_goes_while_a_later_chunks_forward_still_runs():
    rig = streaming(PipelineRig())
    rig.ready(0.0, src=(4, 5, 6), final=False)  # its forward's fence completed
    rig.ready(0.0, src=(9,), first=3, fence=Pending())  # its forward still runs
    rig.tick(0.0)
    (write,) = rig.writes()
    assert blocks_of(write) == both([4, 5, 6], [10, 11, 12])
    assert rig.phase() is Phase.IN_FLIGHT

    rig.pipeline.on_prefill_cancel("t1", 0.1)  # the fence never completes
    assert rig.finished == ["req-1"] and len(rig.writes()) == 1
    assert rig.failures() == [("t1", Cause.CANCELLED)]
    rig.assert_nothing_held()


def test_late_chunks_ready_before_the_claim_catch_up_in_one_write():
    rig = claimable(PipelineRig())
    rig.ready(0.0, src=(4, 5), final=False, late=True)
    rig.ready(0.1, src=(6, 9), first=2, late=True)
    rig.tick(0.1)
    assert rig.writes() == []

    rig.register(0.2, engine="d1", route=b"route-d1-sched", token=TOKEN)
    rig.tick(0.2)
    (write,) = rig.writes()
    assert blocks_of(write) == both(list(SRC), list(DST))
    assert write.message == DONE and write.peer == "kvpush-d1"
    rig.assert_nothing_held()


def test_a_claim_token_for_an_early_leg_is_a_mismatch():
    rig = claimable(PipelineRig())
    rig.ready(0.0)  # early: names d0
    rig.register(0.1, token=TOKEN)

    assert rig.finished == ["req-1"]
    assert rig.counters.get("rejected.mismatch") == 1
    assert {c for _, c in rig.failures()} == {Cause.REJECTED}
    rig.tick(0.1)
    assert rig.writes() == []
    rig.assert_nothing_held()


def test_a_failure_lost_while_decode_was_away_is_said_again():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0)
    rig.pipeline.on_prefill_cancel("t1", 0.1)  # told on a socket now dead
    (lost,) = rig.sent_to(REG_ROUTE)[-1:]

    rig.reconcile(1.0, NEW_ROUTE)

    assert rig.sent_to(NEW_ROUTE) == [lost], "the same word, on the live socket"
    assert rig.counters.get("failed.cancelled") == 1, "said again, not anew"
    rig.assert_nothing_held()


def test_a_write_in_flight_across_the_reconnect_completes_with_its_done():
    rig = streaming(PipelineRig())
    rig.io.script_polls(*FOREVER)
    rig.ready(0.0)
    rig.tick(0.0)
    rig.reconcile(0.1, NEW_ROUTE)
    assert rig.counters.get("reconciled.live") == 1
    assert rig.sent_to(NEW_ROUTE) == []

    end_write(rig.writes()[0])
    rig.tick(0.2)
    assert rig.finished == ["req-1"] and rig.notifications() == [DONE]
    assert rig.failures() == []
    rig.assert_nothing_held()


def test_a_write_cancelled_before_the_partition_answers_on_the_new_socket():
    rig = streaming(PipelineRig())
    rig.io.script_polls(*FOREVER)
    rig.ready(0.0)
    rig.tick(0.0)
    rig.cancel(0.1, route=b"route-d0-before")  # answered once the WRITE ended
    rig.reconcile(0.2, NEW_ROUTE)
    assert rig.failures() == [], "the WRITE may still land"

    end_write(rig.writes()[0], "ERR")
    rig.tick(0.3)
    assert rig.failures() == [("t1", Cause.WRITE_FAILED)]
    assert rig.failures(NEW_ROUTE) == [("t1", Cause.WRITE_FAILED)]
    rig.assert_nothing_held()
