"""Coalescing: descriptors copy exactly the requested block pairs, once each,
in as many descriptors as there are runs contiguous on both sides. Also the
KV layout they are computed from."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.transfer.coalesce import Desc, Descs, Run, desc_list, descriptors, runs
from kvpush.transfer.layout import KvLayout, compat_problem

BB = 96  # block bytes
SRC = KvLayout.contiguous_layers(0x1000, 3, num_blocks=64, block_bytes=BB, block_size=4)
DST = KvLayout.contiguous_layers(
    0x900000, 3, num_blocks=80, block_bytes=BB, block_size=4
)
# K and V in separate regions, two per layer, at scattered addresses.
SPLIT_SRC = KvLayout(
    64, BB, 4, base_addrs=(0x10000, 0x40000, 0x70000, 0xA0000), regions_per_layer=2
)
SPLIT_DST = KvLayout(
    80, BB, 4, base_addrs=(0x200000, 0x100000, 0x500000, 0x300000), regions_per_layer=2
)


def _maximal_runs(src: list[int], dst: list[int]) -> int:
    """Independent count: a new run starts wherever either side breaks."""
    breaks = sum(
        1
        for i in range(1, len(src))
        if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1
    )
    return 1 + breaks if src else 0


def _runs(src: list[int], dst: list[int]) -> list[Run]:
    return [Run(*row) for row in runs(src, dst).tolist()]


def _locate(layout: KvLayout, addr: int) -> tuple[int, int]:
    """(region, block id) of the block starting at ``addr``."""
    for region, base in enumerate(layout.base_addrs):
        offset = addr - base
        if 0 <= offset < layout.num_blocks * BB:
            assert offset % BB == 0
            return region, offset // BB
    raise AssertionError(f"address {addr:#x} is in no region")


def _copied_pairs(
    src_descs: Descs, dst_descs: Descs, src: KvLayout, dst: KvLayout
) -> Counter[tuple[int, int, int, int]]:
    """Every (src region, src block, dst region, dst block) the descriptors copy."""
    assert src_descs.shape == dst_descs.shape == (len(src_descs), 3)
    out: Counter[tuple[int, int, int, int]] = Counter()
    for s, d in zip(desc_list(src_descs), desc_list(dst_descs), strict=True):
        assert s.length == d.length > 0 and s.length % BB == 0
        for k in range(s.length // BB):
            out[(*_locate(src, s.addr + k * BB), *_locate(dst, d.addr + k * BB))] += 1
    return out


@st.composite
def block_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Pairs with plenty of accidental and deliberate contiguity."""
    n = draw(st.integers(0, 40))
    dst = draw(st.lists(st.integers(0, 79), min_size=n, max_size=n, unique=True))
    if draw(st.booleans()):
        src = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n))
    else:  # follow dst with a few jumps, so long runs are common
        shift = draw(st.integers(-16, 16))
        src = [min(63, max(0, d + shift)) for d in dst]
    return src, dst


@given(block_pairs(), st.integers(0, 2), st.integers(1, 3), st.booleans())
def test_descriptors_copy_each_pair_once_in_minimal_count(
    pairs: tuple[list[int], list[int]], first: int, count: int, split: bool
) -> None:
    src, dst = pairs
    src_layout, dst_layout = (SPLIT_SRC, SPLIT_DST) if split else (SRC, DST)
    layers = range(first, min(src_layout.num_layers, first + count))
    rpl = src_layout.regions_per_layer
    src_descs, dst_descs = descriptors(runs(src, dst), src_layout, dst_layout, layers)

    expected = Counter(
        (r, s, r, d)
        for layer in layers
        for r in range(layer * rpl, (layer + 1) * rpl)
        for s, d in zip(src, dst, strict=True)
    )
    assert _copied_pairs(src_descs, dst_descs, src_layout, dst_layout) == expected
    assert len(src_descs) == _maximal_runs(src, dst) * len(layers) * rpl


def test_runs_merge_only_where_both_sides_are_consecutive() -> None:
    assert _runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 7]) == [
        Run(4, 0, 3),
        Run(9, 3, 2),
        Run(2, 7, 1),
    ]
    # Source consecutive but destination not: no merge.
    assert _runs([1, 2, 3], [5, 7, 6]) == [Run(1, 5, 1), Run(2, 7, 1), Run(3, 6, 1)]
    # Descending on both sides is not contiguous memory in copy order.
    assert _runs([3, 2], [3, 2]) == [Run(3, 3, 1), Run(2, 2, 1)]
    assert _runs([], []) == []
    assert runs([], []).shape == (0, 3)


def test_descriptors_by_hand_on_the_cpu_layout() -> None:
    src_descs, dst_descs = descriptors(
        [Run(4, 0, 3), Run(9, 3, 1)], SRC, DST, range(1, 3)
    )
    layer_src, layer_dst = 64 * BB, 80 * BB
    assert desc_list(src_descs) == [
        Desc(0x1000 + layer_src + 4 * BB, 3 * BB, 0),
        Desc(0x1000 + layer_src + 9 * BB, BB, 0),
        Desc(0x1000 + 2 * layer_src + 4 * BB, 3 * BB, 0),
        Desc(0x1000 + 2 * layer_src + 9 * BB, BB, 0),
    ]
    assert desc_list(dst_descs)[0] == Desc(0x900000 + layer_dst, 3 * BB, 0)
    assert desc_list(dst_descs)[3] == Desc(0x900000 + 2 * layer_dst + 3 * BB, BB, 0)


def test_descriptors_are_what_nixl_takes_without_a_copy() -> None:
    src_descs, dst_descs = descriptors(runs([4, 5, 9], [0, 1, 3]), SRC, DST, range(3))
    for descs in (src_descs, dst_descs):
        assert descs.dtype == np.uint64 and descs.shape == (6, 3)
        assert descs.flags["C_CONTIGUOUS"]
    as_rows = descriptors([Run(4, 0, 2), Run(9, 3, 1)], SRC, DST, range(3))
    assert np.array_equal(as_rows[0], src_descs)
    assert np.array_equal(as_rows[1], dst_descs)


def test_descriptors_reach_the_top_of_the_address_space() -> None:
    top = 2**64 - 64 * BB  # the last region a layout may describe
    high = KvLayout(64, BB, 4, base_addrs=(top,), device_id=3)
    low = KvLayout(64, BB, 4, base_addrs=(0,), device_id=1)
    src_descs, dst_descs = descriptors(runs([63], [0]), high, low, range(1))
    assert desc_list(src_descs) == [Desc(top + 63 * BB, BB, 3)]
    assert desc_list(dst_descs) == [Desc(0, BB, 1)]


def test_descriptors_of_no_runs_are_empty() -> None:
    src_descs, dst_descs = descriptors(runs([], []), SRC, DST, range(3))
    assert src_descs.shape == dst_descs.shape == (0, 3)


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ([1, 2], [1], "2 source blocks but 1 destination"),
        ([-1], [0], "non-negative"),
        ([0], [-3], "non-negative"),
        ([1, 2], [5, 5], "must not repeat"),
    ],
)
def test_runs_validate_their_input(
    src: list[int], dst: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        runs(src, dst)


def test_runs_allow_a_source_block_to_be_read_twice() -> None:
    assert _runs([1, 1], [2, 3]) == [Run(1, 2, 1), Run(1, 3, 1)]


@pytest.mark.parametrize(
    ("block_runs", "src", "dst", "layers", "message"),
    [
        ([Run(60, 0, 5)], SRC, DST, range(3), "reads past"),
        ([Run(0, 78, 3)], SRC, DST, range(3), "writes past"),
        ([Run(0, 0, 0)], SRC, DST, range(3), "invalid run"),
        ([Run(-1, 0, 1)], SRC, DST, range(3), "invalid run"),
        # The first bad run is named, by the first rule it breaks.
        ([Run(0, 0, 1), Run(0, 79, 2), Run(63, 0, 2)], SRC, DST, range(3), "writes"),
        ([Run(0, 0, 1)], SRC, DST, range(4), "within 0..3"),
        ([Run(0, 0, 1)], SRC, DST, range(0, 3, 2), "step-1"),
        ([Run(0, 0, 1)], SRC, SPLIT_DST, range(1), "different regions"),
        (
            [Run(0, 0, 1)],
            SRC,
            KvLayout.contiguous_layers(0, 3, 80, BB * 2, 8),
            range(1),
            "block sizes differ",
        ),
    ],
)
def test_descriptors_validate_their_input(
    block_runs: list[Run], src: KvLayout, dst: KvLayout, layers: range, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        descriptors(block_runs, src, dst, layers)


# -- layout -----------------------------------------------------------------


def test_cpu_layout_puts_layers_one_after_another() -> None:
    assert SRC.num_layers == 3
    assert SRC.base_addrs == (0x1000, 0x1000 + 64 * BB, 0x1000 + 128 * BB)
    assert SRC.block_addr(2, 5) == 0x1000 + 128 * BB + 5 * BB
    assert SPLIT_SRC.regions(1) == range(2, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0}, ">= 1"),
        ({"block_bytes": 0}, ">= 1"),
        ({"base_addrs": ()}, "positive multiple"),
        ({"base_addrs": (0, 1, 2), "regions_per_layer": 2}, "positive multiple"),
        ({"base_addrs": (2**64 - 10,)}, "out of range"),
        ({"base_addrs": (-1,)}, "out of range"),
    ],
)
def test_layout_validates_at_construction(
    kwargs: dict[str, object], message: str
) -> None:
    base: dict[str, object] = {
        "num_blocks": 4,
        "block_bytes": 8,
        "block_size": 2,
        "base_addrs": (0,),
    }
    with pytest.raises(ValueError, match=message):
        KvLayout(**{**base, **kwargs})  # type: ignore[arg-type]


def test_layout_rejects_out_of_range_lookups() -> None:
    with pytest.raises(ValueError, match="block id 64"):
        SRC.block_addr(0, 64)
    with pytest.raises(ValueError, match="layer 3"):
        SRC.regions(3)


def test_compat_problem_names_the_first_difference() -> None:
    assert compat_problem(SRC, DST) is None  # num_blocks may differ
    other_bs = KvLayout.contiguous_layers(0, 3, 64, BB, block_size=8)
    assert "block_size differs" in (compat_problem(SRC, other_bs) or "")
    two_layers = KvLayout.contiguous_layers(0, 2, 64, BB, block_size=4)
    assert "num_layers differs" in (compat_problem(SRC, two_layers) or "")
    typed = KvLayout.contiguous_layers(0, 3, 64, BB, 4, kv_dtype="float32")
    assert "kv_dtype" in (compat_problem(SRC, typed) or "")
