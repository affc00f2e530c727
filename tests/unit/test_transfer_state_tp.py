"""State pages across TP sizes (kvpush.transfer.state_pages), checked by
simulation: shard a model's state the way vLLM does for each TP size,
apply every writer's pieces to empty decode pages, and require each decode
page to equal its own shard, every byte written exactly once."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvpush.transfer.digest import destination_ranges, digest, source_ranges
from kvpush.transfer.heads import group_descriptors, slice_problem
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.ranks import TpPair
from kvpush.transfer.shares import HeadShare, TpMapping
from kvpush.transfer.state_pages import (
    ConvLayout,
    StatePage,
    StatePart,
    state_writers_problem,
)

ITEM = 4  # int32 stand-ins for the state's elements


def mamba2(layout: ConvLayout, groups: int = 1) -> StatePage:
    """Nemotron-H-like: 16 heads of 32, ``groups`` groups of 16, 3 rows."""
    return StatePage(
        kind="mamba2",
        cache_mode="none",
        conv_layout=layout,
        conv_rows=3,
        conv_item_bytes=ITEM,
        conv_parts=(StatePart(16, 32), StatePart(groups, 16), StatePart(groups, 16)),
        recurrent=StatePart(16, 32 * 16 * ITEM),
    )


def gdn(layout: ConvLayout) -> StatePage:
    """Qwen3-Next-like: Q, K of 2 heads of 64, V of 4 heads of 64."""
    return StatePage(
        kind="gdn_attn",
        cache_mode="none",
        conv_layout=layout,
        conv_rows=3,
        conv_item_bytes=ITEM,
        conv_parts=(StatePart(2, 64), StatePart(2, 64), StatePart(4, 64)),
        recurrent=StatePart(4, 64 * 64 * ITEM),
    )


def short_conv(layout: ConvLayout) -> StatePage:
    """LFM2-like: a conv state of 256 channels, no recurrent state."""
    return StatePage(
        kind="short_conv",
        cache_mode="none",
        conv_layout=layout,
        conv_rows=2,
        conv_item_bytes=ITEM,
        conv_parts=(StatePart(256, 1),),
        recurrent=None,
    )


def shard(page: StatePage, tp: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s page bytes as vLLM lays them out: each element names
    its part, global channel and row (conv) or unit and word (recurrent)."""
    columns = []
    for p, part in enumerate(page.conv_parts):
        for unit in HeadShare(tp, rank, part.units).heads:
            for c in range(part.width):
                columns.append(1_000_000 * (p + 1) + unit * part.width + c)
    cols = np.asarray(columns, dtype=np.int32)
    conv = cols[None, :] * 8 + np.arange(page.conv_rows, dtype=np.int32)[:, None]
    if page.conv_layout is ConvLayout.DS:
        conv = conv.T
    recurrent = np.empty(0, dtype=np.int32)
    if page.recurrent is not None:
        words = page.recurrent.width // ITEM
        units = np.asarray(list(HeadShare(tp, rank, page.recurrent.units).heads))
        recurrent = -(units[:, None] * words + np.arange(words)[None, :]) - 1
    out = np.concatenate([conv.ravel(), recurrent.astype(np.int32).ravel()])
    assert out.size * ITEM == page.content_bytes(tp)
    return out.view(np.uint8)


PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]


@pytest.mark.parametrize("layout", list(ConvLayout))
@pytest.mark.parametrize("make", [mamba2, gdn, short_conv])
@pytest.mark.parametrize(("src_tp", "dst_tp"), PAIRS)
def test_every_decode_byte_written_once_from_the_right_source(
    layout: ConvLayout, make, src_tp: int, dst_tp: int
) -> None:
    page = make(layout)
    sources = [shard(page, src_tp, p) for p in range(src_tp)]
    for d in range(dst_tp):
        want = shard(page, dst_tp, d)
        got = np.zeros_like(want)
        times = np.zeros(want.size, dtype=np.int64)
        for p in page.writers_of(src_tp, dst_tp, d):
            for src, dst, n in page.pieces(src_tp, p, dst_tp, d).tolist():
                got[dst : dst + n] = sources[p][src : src + n]
                times[dst : dst + n] += 1
        assert (times == 1).all(), f"decode rank {d}: bytes written {set(times)}"
        assert (got == want).all()


@pytest.mark.parametrize("layout", list(ConvLayout))
def test_equal_tp_copies_a_page_as_one_piece_of_its_content(layout) -> None:
    page = mamba2(layout)
    for tp in (1, 2):
        for r in range(tp):
            pieces = page.pieces(tp, r, tp, r)
            assert pieces.tolist() == [[0, 0, page.content_bytes(tp)]]
            others = [page.pieces(tp, q, tp, r) for q in range(tp) if q != r]
            assert all(o.size == 0 for o in others)


def test_a_replicated_group_is_read_from_one_copy() -> None:
    """Mamba2's one group at prefill TP 2 lives on both ranks: decode TP 1
    takes it from rank 0 only, the heads from both."""
    page = mamba2(ConvLayout.DS)
    assert page.writers_of(2, 1, 0) == {0, 1}
    rank1 = page.pieces(2, 1, 1, 0)
    conv = page.conv_bytes(1)
    x_half = 8 * 32 * 3 * ITEM
    # rank 1 gives the second half of x and of the heads, no group
    assert rank1[:, 2].sum() == x_half + 8 * page.recurrent.width
    assert (rank1[:, 1] < conv).sum() == 1


def test_sd_layout_joins_what_follows_on_both_sides() -> None:
    """From TP 1 to decode rank 0: row 0's half of x, then row 0's group
    (B, C) joined with row 1's half of x (they follow each other in both
    pages), and so on; the last row's group joins the first half of the
    heads. Rank 1: each row's half of x, B and C, then the heads."""
    page = mamba2(ConvLayout.SD)
    row = 544 * ITEM  # one TP 1 row: 512 x + 16 B + 16 C channels
    assert page.pieces(1, 0, 2, 0)[:, 0].tolist() == [
        0,
        2048,
        2048 + row,
        2048 + 2 * row,
    ]
    assert len(page.pieces(1, 0, 2, 1)) == 3 + 1


def test_writers_outside_the_kv_mapping_are_refused() -> None:
    page = mamba2(ConvLayout.DS)
    kv = TpMapping(2, 1, 2)
    ok = [kv.writers_of(d) for d in range(1)]
    assert state_writers_problem(page, 2, 1, ok) is None
    only_rank0 = [frozenset({0})]
    problem = state_writers_problem(page, 2, 1, only_rank0)
    assert problem is not None and "prefill rank(s) [1]" in problem


def test_a_tp_size_a_part_does_not_split_over_is_refused_by_name() -> None:
    page = gdn(ConvLayout.SD)
    assert page.problem(2) is None
    problem = page.problem(3)
    assert problem is not None and "does not split over TP 3" in problem
    assert state_writers_problem(page, 1, 3, [frozenset({0})] * 3) == problem


def test_ranks_out_of_range_raise() -> None:
    page = mamba2(ConvLayout.DS)
    with pytest.raises(ValueError):
        page.pieces(1, 1, 2, 0)
    with pytest.raises(ValueError):
        page.pieces(1, 0, 2, 2)


def test_round_trips_the_wire() -> None:
    import msgspec

    page = gdn(ConvLayout.DS)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(page), type=StatePage) == page
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({**msgspec.structs.asdict(page), "conv_parts": []}),
            type=StatePage,
        )


# --- WRITE descriptors and digests over real memory, prefill TP 1 -> decode TP 2


SLOTS, BLOCKS = 2, 4
KINDS = ("state:mamba2:x", "full")


class Instance:
    """One rank's cache in numpy memory: ``SLOTS`` layer slots of ``BLOCKS``
    blocks, a state group and a full-attention group sharing them."""

    def __init__(self, page: StatePage, tp: int, rank: int, block_bytes: int):
        self.memory = np.zeros(SLOTS * BLOCKS * block_bytes, dtype=np.uint8)
        base = self.memory.ctypes.data
        self.layout = KvLayout(
            num_blocks=BLOCKS, block_bytes=block_bytes, block_size=16,
            base_addrs=tuple(base + s * BLOCKS * block_bytes for s in range(SLOTS)),
            kv_groups=KINDS, group_copy_bytes=(page.content_bytes(tp), 0),
            group_states=(page, None),
        )  # fmt: skip
        self.block_bytes = block_bytes

    def block(self, slot: int, block_id: int) -> np.ndarray:
        start = (slot * BLOCKS + block_id) * self.block_bytes
        return self.memory[start : start + self.block_bytes]


def read(addr: int, length: int) -> bytes:
    return ctypes.string_at(addr, length)


def test_a_tp1_page_lands_split_on_two_decode_ranks_digests_equal() -> None:
    page = mamba2(ConvLayout.SD)
    head_bytes = 20480  # one attention head of a block; pages fit in it
    prefill = Instance(page, 1, 0, 2 * head_bytes)
    decodes = [Instance(page, 2, d, head_bytes) for d in range(2)]
    src_ids, dst_ids = ((3,), (0, 1)), ((2,), (1, 3))  # state block, full blocks
    for slot in range(SLOTS):
        prefill.block(slot, 3)[: page.content_bytes(1)] = shard(page, 1, 0)
        for b in (0, 1):
            prefill.block(slot, b)[:] = np.random.default_rng(slot * 8 + b).integers(
                0, 256, 2 * head_bytes, dtype=np.uint8
            )
    pair = TpPair(1, 2, 2)
    for d, decode in enumerate(decodes):
        (head_slice,) = [s for s in pair.targets_of(0) if s.dst_rank == d]
        src_d, dst_d, _ = group_descriptors(
            src_ids, dst_ids, prefill.layout, decode.layout, range(SLOTS), head_slice
        )
        for (src, n, _), (dst, m, _) in zip(
            src_d.tolist(), dst_d.tolist(), strict=True
        ):
            assert n == m
            ctypes.memmove(dst, src, n)
        want_state = shard(page, 2, d)
        for slot in range(SLOTS):
            got = decode.block(slot, 2)
            assert (got[: want_state.size] == want_state).all()
            assert not got[want_state.size :].any(), "padding was written"
            for src_b, dst_b in ((0, 1), (1, 3)):
                head = prefill.block(slot, src_b)[d * head_bytes : (d + 1) * head_bytes]
                assert (decode.block(slot, dst_b) == head).all()
        sent = source_ranges(
            src_ids, dst_ids, prefill.layout, decode.layout, head_slice
        )
        landed = destination_ranges(dst_ids, decode.layout, head_slice)
        assert digest(sent, read) == digest(landed, read)
        decode.block(1, 2)[want_state.size] ^= 0xFF  # padding: not hashed
        assert digest(landed, read) == digest(sent, read)
        decode.block(1, 2)[want_state.size - 1] ^= 0xFF  # the state's last byte
        assert digest(landed, read) != digest(sent, read)


def test_layouts_of_different_tp_compare_their_state_pages() -> None:
    page = mamba2(ConvLayout.SD)
    one, two = Instance(page, 1, 0, 40960), Instance(page, 2, 0, 20480)
    head_slice = TpPair(1, 2, 2).targets_of(0)[0]
    assert slice_problem(one.layout, two.layout, head_slice) is None
    other = Instance(mamba2(ConvLayout.DS), 2, 0, 20480)
    problem = slice_problem(one.layout, other.layout, head_slice)
    assert problem is not None and "state page differs" in problem
