"""A prefill stream keeps one block list per KV-cache group: every chunk
names the same groups, each as long as the others, no id twice; its
WRITEs pair each group's blocks by prompt block, from decode's
``first_block``."""

from __future__ import annotations

from kvpush.connector.prefill.fence import NO_FENCE
from kvpush.connector.prefill.stream import Stream
from kvpush.transfer.groups import of
from kvpush.transfer.matcher import Matched, ReadyKv
from kvpush.transfer.messages import Registration
from kvpush.transfer.shares import HeadShare, HeadSlice

WHOLE = HeadSlice(HeadShare(1, 0, 1), HeadShare(1, 0, 1), 0, 1)
TOKENS = 64  # 4 blocks of 16


def chunk(first: int, src: list[list[int]], final: bool = False) -> ReadyKv:
    return ReadyKv("t1", of(src), TOKENS, "d0", first_block=first, final=final)


def test_a_chunk_of_other_groups_is_refused_and_changes_nothing() -> None:
    s = Stream("req-1", chunk(0, [[1, 2], [11, 12]]), NO_FENCE)
    assert "1 KV-cache groups, not 2" in (s.add(chunk(2, [[3, 4]]), NO_FENCE) or "")
    assert "unequal" in (s.add(chunk(2, [[3, 4], [13]]), NO_FENCE) or "")
    assert s.add(chunk(2, [[3, 4], [13, 2]]), NO_FENCE) == "source block ids repeat"
    assert s.add(chunk(2, [[3, 4], [13, 14]], final=True), NO_FENCE) is None


def test_writes_pair_every_group_by_prompt_block_from_decodes_first_block() -> None:
    s = Stream("req-1", chunk(0, [[1, 2], [11, 12]]), NO_FENCE)
    s.add(chunk(2, [[3, 4], [13, 14]], final=True), NO_FENCE)
    dst = of([[7, 8, 9], [17, 18, 19]])
    reg = Registration("t1", "d0", "boot-1", dst, TOKENS, 10.0, first_block=1)
    s.match(Matched("t1", reg, chunk(0, [[1], [11]]), (), dst, 10.0), 16, 2, (WHOLE,))
    write = s.next_write()
    assert write is not None and write.notify
    (item,) = write.items
    assert (item.src_block_ids, item.dst_block_ids) == (
        of([[2, 3, 4], [12, 13, 14]]),
        dst,
    )
    assert s.whole() == (of([[2, 3, 4], [12, 13, 14]]), dst)
