"""KV digests (issue "Silent corruption", item 10): prefill's Done carries
the digest of the bytes it wrote to one decode rank; decode checks it
against its own memory before the receive counts as done, and fails the
receive (load errors: vLLM recomputes) on a mismatch.

A real writer thread (:class:`~tests.unit.test_connector_writer.Rig`)
pushes; :class:`~tests.fakes.fake_nixl.FakeMemory` applies its WRITEs to
decode's memory; a decode worker rank (NIXL faked, its verifier inline)
takes the Done notifications and checks them.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.decode.receiver import Check
from kvpush.connector.decode.verify import Verifier
from kvpush.connector.faults import FaultSource
from kvpush.connector.metadata import DecodeMetadata, RecvExpect
from kvpush.connector.prefill.fence import NO_FENCE, LayerFences
from kvpush.launcher.config import ClusterConfig
from kvpush.launcher.instances import kv_transfer_config, plan_instances
from kvpush.transfer.digest import (
    VerifyPolicy,
    destination_ranges,
    digest,
    sample_point,
    source_ranges,
)
from kvpush.transfer.groups import of, one
from kvpush.transfer.messages import Done, decode
from kvpush.transfer.ranks import TpPair
from tests.fakes.fake_nixl import FakeMemory, FakeNixlIO, wait_for
from tests.unit.test_connector_tp_hetero import DST, Cluster
from tests.unit.test_connector_worker import (
    PREFILL_ADDR,
    Decode,
    FakeTime,
    InlineProgress,
    clock,  # noqa: F401  (a fixture)
    close_decode,
    make_decode,
)
from tests.unit.test_connector_writer import Rig
from tests.unit.test_connector_writer_layers import chunk as layer_chunk
from tests.unit.test_connector_writer_layers import posted_and_ended

ALL = VerifyPolicy("all")


def fill(memory: FakeMemory) -> None:
    memory.data[:] = os.urandom(len(memory.data))


def decode_side(
    clock: FakeTime,  # noqa: F811
    io: FakeNixlIO,
    memory: FakeMemory,
    verify: str = "all",
    rank: int = 0,
    tp_size: int = 1,
    heads: int = 0,
    fault_file: str = "",
    sample: float = 0.01,
) -> Decode:
    """Decode worker rank ``rank`` over ``io`` (its notifications) and
    ``memory`` (what the WRITEs landed in), checking digests inline."""
    d = make_decode(
        clock, rank, tp_size, heads, verify_kv=verify, verify_kv_sample=sample
    )
    d.worker._io, d.io = io, io  # type: ignore[assignment]
    d.worker._progress = InlineProgress(io)  # type: ignore[assignment]
    d.worker._verifier = Verifier(
        io.layout, memory, rank, tp_size, heads, FaultSource(fault_file), True
    )
    return d


def expect(tid: str = "t1", req_id: str = "req-1", prefill_tp: int = 1) -> RecvExpect:
    return RecvExpect(req_id, tid, one(DST), "p0", *PREFILL_ADDR, prefill_tp=prefill_tp)


def receive(d: Decode, tid: str = "t1", req_id: str = "req-1", tp: int = 1) -> set[str]:
    d.worker.bind(DecodeMetadata(expects=[expect(tid, req_id, tp)]))
    return d.worker.get_finished()


def land(rig: Rig, dst: FakeMemory) -> None:
    for write in rig.io.writes_snapshot():
        rig.memory.copy(write, dst)


@pytest.fixture
def pushed() -> Iterator[tuple[Rig, FakeMemory]]:
    """One transfer pushed and landed, with digests on."""
    rig = Rig(verify=ALL)
    fill(rig.memory)
    rig.hello()
    rig.register()
    rig.ready()
    assert rig.wait_finished("req-1")
    dst = FakeMemory(rig.decode_io.layout)
    land(rig, dst)
    yield rig, dst
    rig.close()


# -- the digest itself ---------------------------------------------------------


def test_prefill_and_decode_hash_the_same_bytes(pushed, clock):  # noqa: F811
    rig, dst = pushed
    (write,) = rig.io.writes_snapshot()
    done = write.message
    assert isinstance(done, Done) and done.digest is not None
    d = decode_side(clock, rig.decode_io, dst)
    assert receive(d) == {"req-1"}
    assert d.worker.take_load_errors() == set()
    assert d.worker.counters.get("digest_verified") == 1
    assert d.worker.counters.get("digest_mismatch") == 0
    close_decode(d)


def test_one_flipped_byte_fails_the_receive_closed(pushed, clock):  # noqa: F811
    rig, dst = pushed
    layer1 = rig.decode_io.layout.base_addrs[1]
    dst.flip(layer1 + DST[2] * rig.decode_io.layout.block_bytes + 17)
    d = decode_side(clock, rig.decode_io, dst)
    assert receive(d) == {"req-1"}, "reported, failed: vLLM recomputes"
    assert d.worker.take_load_errors() == set(DST), "no block of it is used"
    counts = d.worker.counters.snapshot()
    assert counts["digest_mismatch"] == 1
    assert counts["receive_failed.digest_mismatch"] == 1
    assert counts["fallback"] == 1
    assert "digest_verified" not in counts
    close_decode(d)


def test_a_byte_outside_the_transfer_is_not_its_business(pushed, clock):  # noqa: F811
    rig, dst = pushed
    dst.flip(rig.decode_io.layout.base_addrs[0] + 20 * 256)  # block 20: not ours
    d = decode_side(clock, rig.decode_io, dst)
    assert receive(d) == {"req-1"}
    assert d.worker.take_load_errors() == set()
    assert d.worker.counters.get("digest_verified") == 1
    close_decode(d)


def test_the_fault_file_corrupts_received_kv_and_it_is_caught(
    pushed,
    clock,  # noqa: F811
    tmp_path: Path,
):
    rig, dst = pushed
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"corrupt_received": True}))
    before = bytes(dst.data)
    d = decode_side(clock, rig.decode_io, dst, fault_file=str(faults))
    assert receive(d) == {"req-1"}
    assert d.worker.take_load_errors() == set(DST)
    assert d.worker.counters.get("digest_mismatch") == 1
    assert sum(a != b for a, b in zip(before, dst.data, strict=True)) == 1
    close_decode(d)


def test_a_done_without_digest_is_counted_and_taken(clock):  # noqa: F811
    """Prefill not verifying (its policy off) while decode does: counted,
    not failed (the launcher gives both roles one policy)."""
    rig = Rig()
    rig.hello()
    rig.register()
    rig.ready()
    assert rig.wait_finished("req-1")
    (write,) = rig.io.writes_snapshot()
    assert isinstance(write.message, Done) and write.message.digest is None
    d = decode_side(clock, rig.decode_io, FakeMemory(rig.decode_io.layout))
    assert receive(d) == {"req-1"}
    assert d.worker.take_load_errors() == set()
    assert d.worker.counters.get("digest_missing") == 1
    close_decode(d)
    rig.close()


def test_verification_off_checks_nothing(pushed, clock):  # noqa: F811
    rig, dst = pushed
    dst.flip(rig.decode_io.layout.base_addrs[0] + DST[0] * 256)
    d = decode_side(clock, rig.decode_io, dst, verify="off")
    assert receive(d) == {"req-1"}
    assert d.worker.take_load_errors() == set()
    assert d.worker.counters.snapshot() == {}
    close_decode(d)


# -- sampling ------------------------------------------------------------------


def test_sample_selects_the_same_transfers_on_both_sides(clock):  # noqa: F811
    policy = VerifyPolicy("sample", 0.5)
    tids = [f"t{i}" for i in range(12)]
    chosen = {t for t in tids if policy.selects(t)}
    assert 0 < len(chosen) < len(tids)
    assert all(policy.selects(t) == (sample_point(t) < 0.5) for t in tids)
    rig = Rig(verify=policy)
    fill(rig.memory)
    rig.hello()
    dst = FakeMemory(rig.decode_io.layout)
    d = decode_side(clock, rig.decode_io, dst, verify="sample", sample=0.5)
    carried = set()
    for n, tid in enumerate(tids):
        rig.register(tid=tid)
        rig.ready(tid=tid, req_id=f"req-{tid}")
        assert rig.wait_finished(f"req-{tid}")
        write = rig.io.writes_snapshot()[n]
        if decode(write.notif).digest is not None:  # type: ignore[union-attr]
            carried.add(tid)
        rig.memory.copy(write, dst)
        assert receive(d, tid, f"req-{tid}") == {f"req-{tid}"}
    assert carried == chosen
    assert d.worker.counters.get("digest_verified") == len(chosen)
    assert d.worker.counters.get("digest_missing") == 0
    assert d.worker.take_load_errors() == set()
    close_decode(d)
    rig.close()


# -- tensor parallelism: each decode rank checks its head slice ----------------


@pytest.mark.parametrize("sizes", [(1, 2), (2, 1), (2, 2)])
def test_every_decode_rank_checks_what_its_writers_wrote(
    sizes: tuple[int, int],
    clock,  # noqa: F811
):
    prefill_tp, decode_tp = sizes
    c = Cluster(prefill_tp, decode_tp, 2, verify=ALL)
    try:
        for mem in c.src_mem:
            fill(mem)
        c.say_hellos()
        c.push()
        c.land()
        bad_rank = decode_tp - 1
        for d in range(decode_tp):
            dst = c.dst_mem[d]
            if d == bad_rank:  # the last byte this rank received
                ranges = destination_ranges(
                    one(DST), c.decode_ios[d].layout, _slice_into(c.pair, d)
                )
                addr, length = (int(x) for x in ranges[-1])
                dst.flip(addr + length - 1)
            side = decode_side(
                clock, c.decode_ios[d], dst, rank=d, tp_size=decode_tp, heads=2
            )
            assert receive(side, tp=prefill_tp) == {"req-1"}
            counts = side.worker.counters.snapshot()
            writers = len(c.pair.sources_of(d))
            if d == bad_rank:
                assert side.worker.take_load_errors() == set(DST)
                assert counts["digest_mismatch"] == 1
                assert counts.get("digest_verified", 0) == writers - 1
            else:
                assert side.worker.take_load_errors() == set()
                assert counts["digest_verified"] == writers
            close_decode(side)
    finally:
        c.close()


def _slice_into(pair: TpPair, d: int):  # the last writer's slice into rank d
    return [s for s in pair.mapping.slices if s.dst_rank == d][-1]


def test_source_and_destination_ranges_cover_the_same_bytes():
    """A partial head slice (P 1 / D 2): prefill's ranges, copied, are
    decode's ranges, in the same order."""
    c = Cluster(1, 2, 2)
    try:
        fill(c.src_mem[0])
        for head_slice in c.pair.targets_of(0):
            d = head_slice.dst_rank
            src = source_ranges(
                one((4, 5, 6, 9)), one(DST), c.rigs[0].io.layout,
                c.decode_ios[d].layout, head_slice,
            )  # fmt: skip
            dst = destination_ranges(one(DST), c.decode_ios[d].layout, head_slice)
            assert src[:, 1].tolist() == dst[:, 1].tolist()
            for (s, n), (t, _) in zip(src.tolist(), dst.tolist(), strict=True):
                c.dst_mem[d].put(t, c.src_mem[0].at(s, n))
            assert digest(src, c.src_mem[0].read) == digest(dst, c.dst_mem[d].read)
    finally:
        c.close()


def test_two_groups_source_and_destination_ranges_hash_the_same_bytes():
    """Blocks in two KV-cache groups, a partial head slice (P 1 / D 2):
    prefill's ranges, copied, are decode's ranges, in the same order, and
    digest alike."""
    c = Cluster(1, 2, 2)
    try:
        fill(c.src_mem[0])
        dst_ids = of([[DST[0], DST[1]], [DST[3], DST[2]]])
        for head_slice in c.pair.targets_of(0):
            d = head_slice.dst_rank
            lay = c.decode_ios[d].layout
            src = source_ranges(
                of([[4, 5], [6, 9]]), dst_ids, c.rigs[0].io.layout, lay, head_slice
            )
            dst = destination_ranges(dst_ids, lay, head_slice)
            assert src[:, 1].tolist() == dst[:, 1].tolist()
            for (s, n), (t, _) in zip(src.tolist(), dst.tolist(), strict=True):
                c.dst_mem[d].put(t, c.src_mem[0].at(s, n))
            assert digest(src, c.src_mem[0].read) == digest(dst, c.dst_mem[d].read)
    finally:
        c.close()


# -- streamed: several WRITEs, one digest over all of them ---------------------


def test_a_transfer_pushed_per_layer_is_digested_whole(clock):  # noqa: F811
    rig = Rig(num_layers=4, verify=ALL)
    fill(rig.memory)
    rig.hello()
    rig.register()
    posted = 0
    for first, blocks, final in ((0, (4, 5), False), (2, (6, 9), True)):
        fences = LayerFences(4)
        layer_chunk(rig, first, blocks, fences, final=final)
        for layer in range(4):  # one WRITE per layer, each as it is written
            rig.writer.layer_saved(fences, layer, NO_FENCE)
            posted += 1
            assert wait_for(lambda n=posted: posted_and_ended(rig, n))
    assert rig.wait_finished("req-1")
    writes = rig.io.writes_snapshot()
    assert len(writes) == 8
    assert [w.notif != b"" for w in writes].count(True) == 1
    dst = FakeMemory(rig.decode_io.layout)
    land(rig, dst)
    d = decode_side(clock, rig.decode_io, dst)
    assert receive(d) == {"req-1"}
    assert d.worker.take_load_errors() == set()
    assert d.worker.counters.get("digest_verified") == 1
    close_decode(d)
    rig.close()


# -- the verifier's own thread -------------------------------------------------


def test_the_verifier_thread_checks_off_the_callers_thread():
    lay = Rig().io.layout  # a layout only; its rig is never used
    memory = FakeMemory(lay)
    fill(memory)
    pair = TpPair(1, 1)
    (head_slice,) = pair.targets_of(0)
    want = digest(destination_ranges(one(DST), lay, head_slice), memory.read)
    verifier = Verifier(lay, memory, 0, 1, 0, FaultSource(""))
    try:
        verifier.submit(Check(expect(), 0, want))
        verifier.submit(Check(expect("t2", "req-2"), 0, b"x" * 32))
        verdicts: list = []
        assert wait_for(lambda: len(verdicts.__iadd__(verifier.take())) == 2)
        assert sorted(verdicts) == [("t1", 0, True), ("t2", 0, False)]
    finally:
        verifier.close()


# -- configuration ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"verify_kv": "some"}, "verify_kv must be one of off, sample, all"),
        ({"verify_kv": "sample", "verify_kv_sample": 0.0}, "verify_kv_sample"),
        ({"verify_kv": "sample", "verify_kv_sample": 1.5}, "verify_kv_sample"),
    ],
)
def test_bad_verify_settings_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorConfig(
            role="decode",
            engine_id="d0",
            side_channel_host="127.0.0.1",
            side_channel_port=5600,
            block_size=16,
            **fields,
        )
    with pytest.raises(ValueError, match=message):
        ClusterConfig(mode="kvpush", **fields)


def test_the_launcher_gives_both_roles_one_policy(tmp_path: Path) -> None:
    config = ClusterConfig(mode="kvpush", verify_kv="sample", verify_kv_sample=0.25)
    for spec in plan_instances(config, tmp_path):
        kv = kv_transfer_config(config, spec)
        assert kv is not None
        extra = kv["kv_connector_extra_config"]
        assert (extra["verify_kv"], extra["verify_kv_sample"]) == ("sample", 0.25)
    off = ClusterConfig(mode="kvpush")
    for spec in plan_instances(off, tmp_path):
        kv = kv_transfer_config(off, spec)
        assert kv is not None and "verify_kv" not in kv["kv_connector_extra_config"]


def test_serve_takes_verify_kv() -> None:
    from kvpush.launcher.cli import add_serve_options, serve_config

    p = argparse.ArgumentParser()
    add_serve_options(p)
    args = p.parse_args(["--role", "decode", "--verify-kv", "all"])
    assert serve_config(args).verify_kv == "all"


def test_tensor_bytes_reads_and_flips_vllms_kv_tensors() -> None:
    import torch

    from kvpush.connector.kv_bytes import TensorBytes
    from kvpush.connector.kv_memory import layout_of

    caches = {f"l{i}": torch.randn(8, 2, 16, 8) for i in range(2)}  # [B,H,N,C]
    lay = layout_of(caches, block_size=16, num_blocks=8)
    memory = TensorBytes(caches, lay)
    before = bytes(caches["l1"][3].view(torch.uint8).reshape(-1).numpy())
    addr = lay.block_addr(1, 3)
    assert bytes(memory.read(addr, lay.block_bytes)) == before
    memory.flip(addr + 5)
    after = bytes(caches["l1"][3].view(torch.uint8).reshape(-1).numpy())
    assert after[5] == 255 - before[5] and after[:5] == before[:5]
    with pytest.raises(ValueError, match="outside the KV cache"):
        memory.read(addr, lay.num_blocks * lay.block_bytes)


def test_a_failure_while_checking_ends_the_receive_and_the_verdict_is_dropped(
    clock,  # noqa: F811
):
    from kvpush.transfer.messages import Cause

    d = make_decode(clock, verify_kv="all")  # no verifier: checks stay queued
    receiver = d.worker._receiver
    receiver.expect(expect(), clock.now)
    receiver.done("t1", 0, clock.now, b"d" * 32)
    assert len(receiver.take_checks()) == 1
    assert receiver.take().finished == set(), "not done while its digest is checked"
    receiver.failed("t1", Cause.CANCELLED, 0, clock.now)
    results = receiver.take()
    assert results.finished == {"req-1"} and results.load_errors == set(DST)
    receiver.checked("t1", 0, True)  # too late: ignored
    assert receiver.take().finished == set()
    assert d.worker.counters.get("digest_verified") == 0
    close_decode(d)
