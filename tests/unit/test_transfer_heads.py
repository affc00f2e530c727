"""Tensor-parallel head mapping: for every (prefill TP, decode TP, KV heads),
applying every rank pair's descriptors to simulated memory writes every byte
of every registered decode block exactly once, from the right head, and
nothing else; in as few descriptors as the layout allows."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.transfer.coalesce import Desc, desc_list, runs
from kvpush.transfer.groups import of, one
from kvpush.transfer.heads import (
    group_descriptors,
    head_split_problem,
    slice_descriptors,
    slice_problem,
)
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.shares import HeadShare, HeadSlice, TpMapping

TP_SIZES = (1, 2, 4, 8)
COMBOS = list(itertools.product(TP_SIZES, TP_SIZES, (1, 2, 4, 8)))
SRC_BLOCKS, DST_BLOCKS = 12, 14
ELEM = 4  # bytes of one int32 cell of the simulated cache


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    regions_per_layer: int
    block_size: int  # tokens
    cells: int  # int32 cells per token per head (K|V of one head)

    @property
    def num_regions(self) -> int:
        return self.num_layers * self.regions_per_layer

    @property
    def head_bytes(self) -> int:
        return self.block_size * self.cells * ELEM


@dataclass
class Rank:
    """One rank's simulated cache: a byte buffer at a fake base address."""

    layout: KvLayout
    memory: npt.NDArray[np.uint8]
    base: int

    def view(self, descs: npt.NDArray[np.uint64]) -> list[slice]:
        out = []
        for d in desc_list(descs):
            start = d.addr - self.base
            assert start >= 0 and start + d.length <= self.memory.size
            out.append(slice(start, start + d.length))
        return out


def _rank(
    geo: Geometry, share: HeadShare, num_blocks: int, base: int, order: list[int]
) -> Rank:
    """An empty rank cache; region ``r`` lies at slot ``order[r]``."""
    block_bytes = share.num_heads * geo.head_bytes
    span = num_blocks * block_bytes
    layout = KvLayout(
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        block_size=geo.block_size,
        base_addrs=tuple(base + slot * span for slot in order),
        regions_per_layer=geo.regions_per_layer,
    )
    memory = np.zeros(geo.num_regions * span, dtype=np.uint8)
    return Rank(layout, memory, base)


def _region(rank: Rank, region: int) -> npt.NDArray[np.uint8]:
    """Region ``region`` of ``rank`` as [blocks, heads, head bytes]."""
    layout = rank.layout
    start = layout.base_addrs[region] - rank.base
    span = layout.num_blocks * layout.block_bytes
    return rank.memory[start : start + span].reshape(layout.num_blocks, -1)


def _true_cache(geo: Geometry, heads: int) -> npt.NDArray[np.uint8]:
    """The full-head prefill cache, [region, block, head, head bytes]: every
    int32 cell a distinct id (region, block, head, token, cell)."""
    cells = geo.num_regions * SRC_BLOCKS * heads * geo.block_size * geo.cells
    ids = np.arange(1, cells + 1, dtype=np.int32)
    return ids.view(np.uint8).reshape(geo.num_regions, SRC_BLOCKS, heads, -1)


@st.composite
def transfers(draw: st.DrawFn) -> tuple[list[int], list[int], Geometry]:
    n = draw(st.integers(0, 10))
    dst = draw(
        st.lists(st.integers(0, DST_BLOCKS - 1), min_size=n, max_size=n, unique=True)
    )
    if draw(st.booleans()):
        src = draw(st.lists(st.integers(0, SRC_BLOCKS - 1), min_size=n, max_size=n))
    else:  # mostly contiguous, so runs coalesce
        src = [min(SRC_BLOCKS - 1, d // 2 + 1) for d in sorted(dst)]
        dst = sorted(dst)
    geo = Geometry(
        num_layers=draw(st.integers(1, 2)),
        regions_per_layer=draw(st.integers(1, 2)),
        block_size=draw(st.sampled_from((1, 2, 4))),
        cells=draw(st.integers(1, 3)),
    )
    return src, dst, geo


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"), COMBOS)
@settings(max_examples=20, deadline=None)
@given(case=transfers(), data=st.data())
def test_every_registered_byte_is_written_once_from_the_right_head(
    prefill_tp: int,
    decode_tp: int,
    heads: int,
    case: tuple[list[int], list[int], Geometry],
    data: st.DataObject,
) -> None:
    src_ids, dst_ids, geo = case
    mapping = TpMapping(prefill_tp, decode_tp, heads)
    order = data.draw(st.permutations(range(geo.num_regions)))
    truth = _true_cache(geo, heads)
    prefill = []
    for p in range(prefill_tp):
        share = mapping.prefill_share(p)
        rank = _rank(geo, share, SRC_BLOCKS, (p + 1) << 32, order)
        for r in range(geo.num_regions):
            _region(rank, r)[:] = truth[r][:, share.heads].reshape(SRC_BLOCKS, -1)
        prefill.append(rank)
    decode = [
        _rank(geo, mapping.decode_share(d), DST_BLOCKS, (d + 100) << 32, order)
        for d in range(decode_tp)
    ]
    writes = [np.zeros(rank.memory.size, dtype=np.int64) for rank in decode]

    block_runs = runs(src_ids, dst_ids)
    for p in range(prefill_tp):
        for s in mapping.transfers_from(p):
            src, dst = prefill[p], decode[s.dst_rank]
            layers = range(geo.num_layers)
            src_descs, dst_descs = slice_descriptors(
                block_runs, src.layout, dst.layout, layers, s
            )
            per_region = len(block_runs) if s.is_whole_block else len(src_ids)
            assert len(src_descs) == len(dst_descs) == per_region * geo.num_regions
            for a, b in zip(src.view(src_descs), dst.view(dst_descs), strict=True):
                assert a.stop - a.start == b.stop - b.start
                dst.memory[b] = src.memory[a]
                writes[s.dst_rank][b] += 1

    for d, rank in enumerate(decode):
        share = mapping.decode_share(d)
        expected = np.zeros_like(rank.memory)
        exp_rank = Rank(rank.layout, expected, rank.base)
        count_rank = Rank(rank.layout, writes[d], rank.base)
        for r in range(geo.num_regions):
            for s, t in zip(src_ids, dst_ids, strict=True):
                _region(exp_rank, r)[t] = truth[r][s, share.heads].reshape(-1)
            registered = np.zeros(DST_BLOCKS, dtype=bool)
            registered[dst_ids] = True
            counts = _region(count_rank, r)
            assert (counts[registered] == 1).all(), "a byte written twice or never"
            assert (counts[~registered] == 0).all(), "an unregistered block written"
        assert np.array_equal(rank.memory, expected)


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"), COMBOS)
def test_each_decode_head_has_one_writer_and_slices_agree(
    prefill_tp: int, decode_tp: int, heads: int
) -> None:
    mapping = TpMapping(prefill_tp, decode_tp, heads)
    for d in range(decode_tp):
        share = mapping.decode_share(d)
        into = [s for s in mapping.slices if s.dst_rank == d]
        carried = [h for s in into for h in s.heads]
        assert carried == list(share.heads)  # each head once, in block order
        assert mapping.writers_of(d) == {s.src_rank for s in into}
        for s in into:
            assert set(s.heads) <= set(mapping.prefill_share(s.src_rank).heads)
    by_source = [s for p in range(prefill_tp) for s in mapping.transfers_from(p)]
    assert set(by_source) == set(mapping.slices)
    assert len(by_source) == len(mapping.slices)
    # Whole blocks exactly where both sides' ranks hold the same head count.
    same = max(1, heads // prefill_tp) == max(1, heads // decode_tp)
    assert (not mapping.splits_heads) == same
    if prefill_tp == decode_tp:
        assert [(s.src_rank, s.dst_rank) for s in mapping.slices] == [
            (i, i) for i in range(prefill_tp)
        ]


@pytest.mark.parametrize(
    ("tp", "heads", "rank", "first", "count"),
    [
        (1, 8, 0, 0, 8),
        (2, 8, 1, 4, 4),
        (8, 8, 5, 5, 1),
        (8, 2, 5, 1, 1),
        (4, 1, 3, 0, 1),
    ],
)
def test_head_share_follows_vllm_sharding(
    tp: int, heads: int, rank: int, first: int, count: int
) -> None:
    share = HeadShare(tp, rank, heads)
    assert (share.first_head, share.num_heads) == (first, count)
    assert share.is_replicated == (tp > heads)


def test_replicated_heads_are_taken_round_robin_by_decode_rank() -> None:
    assert [TpMapping(2, 8, 1).writers_of(d) for d in range(4)] == [
        {0},
        {1},
        {0},
        {1},
    ]
    assert TpMapping(8, 1, 2).writers_of(0) == {0, 4}  # copy 0 of heads 0 and 1
    assert [TpMapping(8, 4, 2).writers_of(d) for d in range(4)] == [
        {0},
        {1},
        {6},
        {7},
    ]
    assert TpMapping(4, 2, 8).writers_of(1) == {2, 3}  # two ranks, one block


def test_worked_example_prefill_tp1_to_decode_tp2() -> None:
    """P TP 1 / D TP 2, 2 heads, 2 layers, blocks [3,4,5] -> [7,8,9]: one
    prefill rank feeds both decode ranks, 3 blocks x 2 layers = 6 descriptors
    per pair (the prefill side's head slices of consecutive blocks are apart)."""
    hb = 64  # bytes of one head of one block
    src = KvLayout.contiguous_layers(
        0, 2, num_blocks=16, block_bytes=2 * hb, block_size=4
    )
    dst = KvLayout.contiguous_layers(1 << 20, 2, 16, block_bytes=hb, block_size=4)
    mapping = TpMapping(1, 2, 2)
    assert mapping.writers_of(0) == mapping.writers_of(1) == {0}
    to_d0, to_d1 = mapping.transfers_from(0)
    assert (to_d1.dst_rank, to_d1.src_heads, to_d1.dst_heads) == (
        1,
        range(1, 2),
        range(1),
    )
    block_runs = runs([3, 4, 5], [7, 8, 9])
    s0, d0 = slice_descriptors(block_runs, src, dst, range(2), to_d0)
    s1, d1 = slice_descriptors(block_runs, src, dst, range(2), to_d1)
    assert len(s0) == len(s1) == 6
    layer = 16 * 2 * hb
    assert desc_list(s1)[:2] == [
        Desc(3 * 2 * hb + hb, hb, 0),
        Desc(4 * 2 * hb + hb, hb, 0),
    ]
    assert desc_list(s1)[3] == Desc(layer + 3 * 2 * hb + hb, hb, 0)
    assert desc_list(d1)[0] == Desc((1 << 20) + 7 * hb, hb, 0)
    assert np.array_equal(d0, d1)  # each decode rank's block is whole
    # Homogeneous TP 2 on the same blocks: one run, 2 descriptors per pair.
    same = TpMapping(2, 2, 2)
    whole = slice_descriptors(block_runs, dst, dst, range(2), same.slices[1])
    assert len(whole[0]) == 2 and desc_list(whole[0])[0].length == 3 * hb


@pytest.mark.parametrize("pair", [TpMapping(1, 1, 2), TpMapping(1, 2, 2)])
def test_one_group_descriptors_equal_the_flat_ones(pair: TpMapping) -> None:
    """Whole blocks and a head slice: a one-group transfer's WRITE is the
    very arrays a flat block list gave."""
    src = KvLayout.contiguous_layers(0, 2, 16, block_bytes=128, block_size=4)
    dst = KvLayout.contiguous_layers(1 << 20, 2, 16, block_bytes=128, block_size=4)
    if not pair.slices[-1].is_whole_block:
        dst = KvLayout.contiguous_layers(1 << 20, 2, 16, block_bytes=64, block_size=4)
    for head_slice in pair.slices:
        flat = slice_descriptors(
            runs([3, 4, 9], [7, 8, 2]), src, dst, range(2), head_slice
        )
        s, d, n = group_descriptors(
            one((3, 4, 9)), one((7, 8, 2)), src, dst, range(2), head_slice
        )
        assert np.array_equal(s, flat[0]) and np.array_equal(d, flat[1])
        assert n == 2  # (3, 4 -> 7, 8) and (9 -> 2)


def test_groups_are_described_in_group_order_skipping_empty_ones() -> None:
    lay = KvLayout.contiguous_layers(0, 2, 16, block_bytes=128, block_size=4)
    (whole,) = TpMapping(1, 1, 2).slices
    s, d, n = group_descriptors(
        of([[1, 2], [], [5]]), of([[3, 4], [], [9]]), lay, lay, range(2), whole
    )
    first = slice_descriptors(runs([1, 2], [3, 4]), lay, lay, range(2), whole)
    last = slice_descriptors(runs([5], [9]), lay, lay, range(2), whole)
    assert np.array_equal(s, np.concatenate([first[0], last[0]]))
    assert np.array_equal(d, np.concatenate([first[1], last[1]]))
    assert n == 2
    s, d, n = group_descriptors(of([[], []]), of([[], []]), lay, lay, range(2), whole)
    assert (len(s), len(d), n) == (0, 0, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((3, 0, 8), "must divide the model's 8 KV heads"),
        ((4, 0, 6), "must divide"),
        ((2, 2, 8), "outside 0..1"),
        ((0, 0, 8), ">= 1"),
        ((2, 0, 0), ">= 1"),
    ],
)
def test_invalid_shares_are_refused(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HeadShare(*args)


def test_invalid_mappings_and_lookups_are_refused() -> None:
    with pytest.raises(ValueError, match="must divide"):
        TpMapping(2, 3, 4)
    mapping = TpMapping(2, 4, 4)
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        mapping.transfers_from(2)
    with pytest.raises(ValueError, match=r"outside 0\.\.3"):
        mapping.writers_of(4)
    with pytest.raises(ValueError, match="does not hold head 3"):
        mapping.writer(3, 0)
    with pytest.raises(ValueError, match="not all held"):
        HeadSlice(HeadShare(2, 0, 4), HeadShare(4, 1, 4), 0, 1)


def test_descriptors_refuse_mismatched_geometry() -> None:
    to_d1 = TpMapping(1, 2, 2).slices[1]
    src = KvLayout.contiguous_layers(0, 2, 16, block_bytes=128, block_size=4)
    dst = KvLayout.contiguous_layers(0, 2, 16, block_bytes=96, block_size=4)
    with pytest.raises(ValueError, match="bytes per head per block differ"):
        slice_descriptors(runs([1], [1]), src, dst, range(2), to_d1)
    odd = KvLayout.contiguous_layers(0, 2, 16, block_bytes=127, block_size=4)
    assert "equal heads" in (slice_problem(odd, dst, to_d1) or "")
    other = KvLayout.contiguous_layers(0, 2, 16, block_bytes=64, block_size=8)
    assert "block_size differs" in (slice_problem(src, other, to_d1) or "")
    fine = KvLayout.contiguous_layers(0, 2, 4, block_bytes=64, block_size=4)
    assert slice_problem(src, fine, to_d1) is None
    with pytest.raises(ValueError, match="writes past"):
        slice_descriptors(runs([1], [4]), src, fine, range(2), to_d1)
    with pytest.raises(ValueError, match="reads past"):
        slice_descriptors(runs([16], [0]), src, fine, range(2), to_d1)
    with pytest.raises(ValueError, match=r"within 0\.\.2"):
        slice_descriptors(runs([1], [0]), src, fine, range(3), to_d1)
    with pytest.raises(ValueError, match="must not repeat"):
        slice_descriptors([(1, 0, 2), (5, 1, 1)], src, fine, range(2), to_d1)


def test_layouts_whose_heads_cannot_be_split_are_refused() -> None:
    split = TpMapping(1, 2, 2)
    assert head_split_problem(split, "LBHNC") is None
    assert "NHD" in (head_split_problem(split, "LBNHC") or "")
    # Whole-block mappings need no split: any interior order will do.
    assert head_split_problem(TpMapping(2, 2, 2), "LBNHC") is None
    assert head_split_problem(TpMapping(4, 8, 2), "LBNHC") is None
    assert head_split_problem(TpMapping(1, 2, 1), "LBNHC") is None  # e.g. MLA


def test_head_share_crosses_the_wire_and_is_checked_on_arrival() -> None:
    share = HeadShare(4, 3, 2)
    assert (
        msgspec.msgpack.decode(msgspec.msgpack.encode(share), type=HeadShare) == share
    )
    bad = msgspec.msgpack.encode({"tp_size": 3, "tp_rank": 0, "total_kv_heads": 8})
    with pytest.raises(msgspec.ValidationError, match="must divide"):
        msgspec.msgpack.decode(bad, type=HeadShare)
