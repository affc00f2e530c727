"""State pages copied in part: a Mamba state fills the first bytes of a
page padded to the attention block (``KvLayout.group_copy_bytes``); a push
copies those bytes only, its descriptors, byte count and digests alike."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.transfer.digest import destination_ranges, digest, source_ranges
from kvpush.transfer.groups import NULL_BLOCK, of
from kvpush.transfer.heads import group_descriptors
from kvpush.transfer.layout import KvLayout, compat_problem
from kvpush.transfer.shares import HeadShare, HeadSlice

BLOCK_BYTES, STATE_BYTES, NUM_BLOCKS = 64, 20, 8
GROUPS = ("state:mamba2:ab12cd34", "state:mamba2:ab12cd34", "full")
WHOLE = HeadSlice(HeadShare(1, 0, 2), HeadShare(1, 0, 2), 0, 2)
HALF = HeadSlice(HeadShare(1, 0, 2), HeadShare(2, 0, 2), 0, 1)


def layout(
    base: int, copies: tuple[int, ...] = (STATE_BYTES, STATE_BYTES, 0)
) -> KvLayout:
    return KvLayout(
        num_blocks=NUM_BLOCKS, block_bytes=BLOCK_BYTES, block_size=16,
        base_addrs=(base, base + NUM_BLOCKS * BLOCK_BYTES),  # two layer slots
        kv_groups=GROUPS, group_copy_bytes=copies,
    )  # fmt: skip


SRC, DST = layout(0x10000), layout(0x80000)
# a 3-block prompt: each state group holds one block, the prompt's last
SRC_IDS = of([[NULL_BLOCK, NULL_BLOCK, 7], [NULL_BLOCK, NULL_BLOCK, 6], [1, 2, 3]])
DST_IDS = of([[NULL_BLOCK, NULL_BLOCK, 5], [NULL_BLOCK, NULL_BLOCK, 4], [1, 2, 3]])


def pairs() -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """The pairs a push copies (null blocks left out, as groups.aligned does)."""
    src = tuple(tuple(b for b in g if b != NULL_BLOCK) for g in SRC_IDS)
    dst = tuple(tuple(b for b in g if b != NULL_BLOCK) for g in DST_IDS)
    return src, dst


def test_a_state_groups_block_is_copied_as_its_state_bytes_only():
    src, dst = pairs()
    src_d, dst_d, num_runs = group_descriptors(src, dst, SRC, DST, range(2), WHOLE)

    rows = src_d.tolist()
    # per state group: one row per slot of STATE_BYTES; the full group one run
    assert [r[1] for r in rows] == [STATE_BYTES] * 4 + [3 * BLOCK_BYTES] * 2
    assert rows[0][0] == SRC.block_addr(0, 7) and rows[1][0] == SRC.block_addr(1, 7)
    assert dst_d.tolist()[2][0] == DST.block_addr(0, 4)
    assert num_runs == 1 + 1 + 1
    assert int(src_d[:, 1].sum()) == 2 * 2 * STATE_BYTES + 2 * 3 * BLOCK_BYTES


def test_a_state_page_is_not_split_between_ranks():
    src, dst = pairs()
    with pytest.raises(ValueError, match="group 0's pages are not described"):
        group_descriptors(src, dst, SRC, DST, range(2), HALF)


def test_prefill_and_decode_digest_the_state_bytes_not_the_padding():
    memory = np.random.default_rng(5).integers(0, 256, 0x100000, dtype=np.uint8)

    def read(addr: int, length: int) -> bytes:
        return memory[addr : addr + length].tobytes()

    src, dst = pairs()
    src_ranges = source_ranges(src, dst, SRC, DST, WHOLE)
    dst_ranges = destination_ranges(DST_IDS, DST, WHOLE)
    # the same bytes (prefill's in runs, decode's block by block)
    assert int(src_ranges[:, 1].sum()) == int(dst_ranges[:, 1].sum())
    src_d, dst_d, _ = group_descriptors(src, dst, SRC, DST, range(2), WHOLE)
    for (s, n, _), (d, _, _) in zip(src_d.tolist(), dst_d.tolist(), strict=True):
        memory[d : d + n] = memory[s : s + n]  # the WRITE

    assert digest(src_ranges, read) == digest(dst_ranges, read)
    padding = DST.block_addr(0, 5) + STATE_BYTES
    memory[padding] ^= 0xFF  # not the state's: not written, not checked
    assert digest(src_ranges, read) == digest(dst_ranges, read)
    memory[padding - 1] ^= 0xFF  # the state's last byte
    assert digest(src_ranges, read) != digest(dst_ranges, read)


@pytest.mark.parametrize(
    ("copies", "problem"),
    [((STATE_BYTES, 0), "name each of the 3 groups"),
     ((BLOCK_BYTES + 1, 0, 0), "at most block_bytes")],
)  # fmt: skip
def test_copy_bytes_must_name_every_group_within_a_block(copies, problem):
    with pytest.raises(ValueError, match=problem):
        layout(0x10000, copies)


def test_instances_whose_state_pages_differ_cannot_copy():
    other = layout(0x80000, (STATE_BYTES + 4, STATE_BYTES + 4, 0))
    assert compat_problem(SRC, other) is not None
    assert "copying 20 bytes" in (compat_problem(SRC, other) or "")
    assert compat_problem(SRC, DST) is None
