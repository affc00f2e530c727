"""Work items: however a transfer is cut (whole, per chunk, per layer), the
items cover every block pair in every layer exactly once and only the last
one notifies."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.transfer.groups import GroupBlocks, of, one
from kvpush.transfer.work import (
    ChunkCursor,
    WorkItem,
    split_layers,
    split_whole,
)

SRC = one((40, 41, 42, 7, 8))
DST = one((3, 4, 5, 6, 90))


def _coverage(items: list[WorkItem]) -> Counter[tuple[int, int, int]]:
    return Counter(
        (layer, s, d)
        for item in items
        for layer in item.layers
        for sg, dg in zip(item.src_block_ids, item.dst_block_ids, strict=True)
        for s, d in zip(sg, dg, strict=True)
    )


def _expected(src: GroupBlocks, dst: GroupBlocks, num_layers: int) -> Counter:
    return Counter(
        (layer, s, d)
        for layer in range(num_layers)
        for sg, dg in zip(src, dst, strict=True)
        for s, d in zip(sg, dg, strict=True)
    )


def _only_last_notifies(items: list[WorkItem]) -> bool:
    return [i.notify for i in items] == [False] * (len(items) - 1) + [True]


def test_whole_request_is_one_notifying_item() -> None:
    (item,) = split_whole("t", SRC, DST, num_layers=4)
    assert item == WorkItem("t", SRC, DST, range(4), notify=True)
    assert item.num_blocks == 5


@given(st.integers(1, 9), st.integers(1, 4))
def test_per_layer_items_cover_every_layer_once(num_layers: int, group: int) -> None:
    items = split_layers(split_whole("t", SRC, DST, num_layers)[0], group)
    assert _coverage(items) == _expected(SRC, DST, num_layers)
    assert _only_last_notifies(items)
    assert all(len(i.layers) <= group for i in items)


@given(st.sets(st.integers(1, 69)), st.integers(1, 3))
def test_chunk_and_layer_cuts_compose(chunk_ends: set[int], group: int) -> None:
    cursor = ChunkCursor("t", DST, 0, 70, block_size=16, num_layers=3)
    items = [
        piece
        for computed in [*sorted(chunk_ends), 70]
        for chunk in cursor.advance(SRC, computed)
        for piece in split_layers(chunk, group)
    ]
    assert _coverage(items) == _expected(SRC, DST, 3)
    assert _only_last_notifies(items)


def test_a_non_notifying_item_stays_silent_when_cut() -> None:
    item = WorkItem("t", SRC, DST, range(3), notify=False)
    assert not any(i.notify for i in split_layers(item))


@pytest.mark.parametrize(
    ("src", "dst", "layers"),
    [
        (one(()), one(()), range(1)),
        (one((1,)), one((1, 2)), range(1)),
        (one((1,)), of([[2], []]), range(1)),  # group counts differ
        (of([[1], [3]]), of([[2], []]), range(1)),  # a group's lengths differ
        (one((1,)), one((2,)), range(0)),
        (one((1,)), one((2,)), range(0, 4, 2)),
        (one((1,)), one((2,)), range(-1, 1)),
    ],
)
def test_work_items_validate(src: GroupBlocks, dst: GroupBlocks, layers: range) -> None:
    with pytest.raises(ValueError):
        WorkItem("t", src, dst, layers, notify=True)
    with pytest.raises(ValueError, match="layers_per_item"):
        split_layers(WorkItem("t", one((1,)), one((2,)), range(2), True), 0)


def test_a_work_item_holds_one_list_per_group() -> None:
    item = WorkItem("t", of([[1, 2], [], [3]]), of([[7, 8], [], [9]]), range(2), True)
    assert item.num_blocks == 3
    assert _coverage([item]) == Counter(
        (layer, s, d) for layer in range(2) for s, d in ((1, 7), (2, 8), (3, 9))
    )


# -- per prompt chunk -------------------------------------------------------


def test_chunk_cursor_sends_complete_blocks_as_chunks_finish() -> None:
    # 70 tokens, block size 16: blocks 0..4, the last holds 6 tokens.
    src = (50, 51, 52, 53, 54)
    cursor = ChunkCursor(
        "t", one((10, 11, 12, 13, 14)), 0, 70, block_size=16, num_layers=2
    )
    assert cursor.advance(one(src[:1]), 10) == []  # block 0 not full yet
    (a,) = cursor.advance(one(src[:3]), 40)  # blocks 0, 1 full; 2 partial
    assert (a.src_block_ids, a.dst_block_ids, a.notify) == (
        one((50, 51)),
        one((10, 11)),
        False,
    )
    assert cursor.advance(one(src[:3]), 40) == []  # nothing new
    (b,) = cursor.advance(one(src), 70)  # prompt done: the partial last block too
    assert (b.src_block_ids, b.dst_block_ids, b.notify) == (
        one((52, 53, 54)),
        one((12, 13, 14)),
        True,
    )
    assert cursor.is_done and cursor.advance(one(src), 70) == []


def test_chunk_cursor_skips_decode_prefix_hits() -> None:
    # Decode already holds blocks 0 and 1: it registered three blocks.
    cursor = ChunkCursor(
        "t", one((7, 8, 9)), first_block=2, num_tokens=80, block_size=16, num_layers=1
    )
    assert cursor.advance(one((1, 2)), 32) == []  # only skipped blocks are complete
    (a,) = cursor.advance(one((1, 2, 3, 4)), 64)
    assert (a.src_block_ids, a.dst_block_ids) == (one((3, 4)), one((7, 8)))
    (b,) = cursor.advance(one((1, 2, 3, 4, 5)), 80)
    assert (b.src_block_ids, b.dst_block_ids, b.notify) == (one((5,)), one((9,)), True)


@given(
    st.integers(1, 200),
    st.integers(1, 20),
    st.integers(0, 8),
    st.lists(st.integers(0, 220), max_size=12),
)
def test_chunk_cursor_covers_every_registered_block_once(
    num_tokens: int, block_size: int, first: int, progress: list[int]
) -> None:
    total = -(-num_tokens // block_size)
    first = min(first, total - 1)
    src = one(range(100, 100 + total))
    dst = one(range(first + 1, total + 1))
    cursor = ChunkCursor("t", dst, first, num_tokens, block_size, num_layers=2)
    items = [
        item
        for computed in [*sorted(progress), num_tokens]
        for item in cursor.advance(src, computed)
    ]
    assert _coverage(items) == _expected(one(src[0][first:]), dst, 2)
    assert _only_last_notifies(items) and cursor.is_done


def test_chunk_cursor_validates() -> None:
    with pytest.raises(ValueError, match="3 blocks"):
        ChunkCursor("t", one((1, 2)), 0, 40, 16, 1)
    with pytest.raises(ValueError, match=">= 1"):
        ChunkCursor("t", one((1, 2, 3)), 0, 40, 0, 1)
    cursor = ChunkCursor("t", one((1, 2, 3)), 0, 40, 16, 1)
    with pytest.raises(ValueError, match="group 0 holds 1 source"):
        cursor.advance(one((9,)), 40)
