"""Block ids per KV-cache group (:mod:`kvpush.transfer.groups`): the one
place a source index is paired with a destination index."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.transfer import groups


def test_one_wraps_a_flat_list_as_one_group() -> None:
    assert groups.one([4, 5, 6]) == ((4, 5, 6),)


def test_flat_and_total_follow_group_order() -> None:
    g = groups.of([[1, 2], [], [7]])
    assert groups.flat(g) == (1, 2, 7)
    assert groups.total(g) == 3


def test_aligned_slices_every_group_by_prompt_block() -> None:
    src = groups.of([[10, 11, 12, 13], [20, 21, 22, 23]])
    dst = groups.of([[31, 32, 33], [41, 42, 43]])  # decode holds block 0
    assert groups.aligned(src, dst, 2, 4, first_block=1) == (
        ((12, 13), (22, 23)),
        ((32, 33), (42, 43)),
    )


def test_aligned_refuses_a_group_count_mismatch() -> None:
    with pytest.raises(ValueError, match="groups cannot pair"):
        groups.aligned(groups.one([1, 2]), groups.of([[3, 4], [5, 6]]), 0, 2, 0)


def test_aligned_refuses_a_group_shorter_than_the_span() -> None:
    src = groups.of([[1, 2, 3], [4, 5]])
    dst = groups.of([[6, 7, 8], [9, 10, 11]])
    with pytest.raises(ValueError, match="group 1 holds 2 source"):
        groups.aligned(src, dst, 0, 3, 0)


def test_aligned_refuses_a_span_before_decodes_first_block() -> None:
    with pytest.raises(ValueError, match="first block 1"):
        groups.aligned(groups.one([1, 2]), groups.one([3]), 0, 2, 1)


def test_an_id_in_two_groups_is_a_problem() -> None:
    assert groups.distinct_problem(groups.of([[1, 2], [3]])) is None
    assert groups.distinct_problem(groups.of([[1, 2], [2]])) is not None


@given(
    st.integers(1, 4),  # groups
    st.integers(1, 12),  # prompt blocks
    st.data(),
)
def test_every_pair_is_one_prompt_block(num_groups: int, n: int, data) -> None:
    """Source ``g * 100 + i + 1`` and destination ``g * 100 + i + 1001``
    name prompt block ``i`` of group ``g``; a group keeps, on decode, blocks
    from ``kept[g]`` on (a window: the null block before), prefill from
    ``held[g] <= kept[g]`` on. Every pair made is one block decode keeps,
    and every block decode keeps in the span is paired."""
    first = data.draw(st.integers(0, n - 1))
    start = data.draw(st.integers(first, n))
    end = data.draw(st.integers(start, n))
    kept = [data.draw(st.integers(0, n)) for _ in range(num_groups)]
    held = [data.draw(st.integers(0, k)) for k in kept]
    null = groups.NULL_BLOCK
    src = groups.of(
        [
            [g * 100 + i + 1 if i >= held[g] else null for i in range(n)]
            for g in range(num_groups)
        ]
    )
    dst = groups.of(
        [
            [g * 100 + i + 1001 if i >= kept[g] else null for i in range(first, n)]
            for g in range(num_groups)
        ]
    )
    s, d = groups.aligned(src, dst, start, end, first)
    assert len(s) == len(d) == num_groups
    for g, (sg, dg) in enumerate(zip(s, d, strict=True)):
        want = [g * 100 + i + 1 for i in range(max(start, kept[g]), end)]
        assert list(sg) == want
        assert all(b + 1000 == a for a, b in zip(dg, sg, strict=True))


def test_a_block_decode_keeps_but_prefill_let_go_is_refused() -> None:
    null = groups.NULL_BLOCK
    with pytest.raises(ValueError, match="group 1: decode keeps a prompt block"):
        groups.aligned(((5, 6), (null, 8)), ((15, 16), (17, 18)), 0, 2, 0)


def test_blocks_decode_does_not_keep_are_left_out() -> None:
    null = groups.NULL_BLOCK
    s, d = groups.aligned(
        ((5, 6, 7), (null, 9, 10)), ((15, 16, 17), (null, null, 20)), 0, 3, 0
    )
    assert (s, d) == (((5, 6, 7), (10,)), ((15, 16, 17), (20,)))


def test_null_blocks_are_not_real_ids() -> None:
    null = groups.NULL_BLOCK
    assert groups.real(((null, 3), (null, null, 4))) == (3, 4)
    assert groups.distinct_problem(((null, 3), (null, 4))) is None
    assert groups.distinct_problem(((3,), (3,))) is not None


def test_a_state_group_goes_with_the_prompts_last_block_only():
    null = groups.NULL_BLOCK
    src = groups.prompt_view(((41,), (1, 2, 3)), (True, False), 3)
    dst = groups.prompt_view(((51,), (11, 12, 13)), (True, False), 3)
    assert src == ((null, null, 41), (1, 2, 3))
    first, _ = groups.aligned(src, dst, 0, 2, 0)  # an earlier chunk
    last = groups.aligned(src, dst, 2, 3, 0)  # the chunk that ends the prompt
    assert first == ((), (1, 2))
    assert last == (((41,), (3,)), ((51,), (13,)))


def test_a_state_group_of_other_than_one_block_is_refused():
    with pytest.raises(ValueError, match="state group 0 holds 2 blocks"):
        groups.prompt_view(((4, 5), (1, 2)), (True, False), 2)
