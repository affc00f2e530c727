"""Prefix awareness: block hashes, the bounded index, session affinity."""

from __future__ import annotations

import pytest

from kvpush.router.prefix import (
    SESSION_KEY_MAX_CHARS,
    PrefixIndex,
    block_hashes,
    rendezvous_order,
    session_key,
)


def test_only_full_blocks_are_hashed_and_each_hash_covers_its_prefix() -> None:
    tokens = list(range(10))
    hashes = block_hashes(tokens, block_size=4)
    assert len(hashes) == 2  # tokens 8 and 9 are a partial block
    assert block_hashes(tokens[:8], 4) == hashes
    other = block_hashes([99, *tokens[1:]], 4)
    assert other[1] != hashes[1]  # same second block, another first one
    assert block_hashes(tokens, 4) == hashes  # deterministic


def test_the_index_counts_the_leading_blocks_a_decode_was_sent() -> None:
    index = PrefixIndex(max_entries=100)
    turn_one = block_hashes(list(range(12)), 4)
    index.record("d0", turn_one)
    turn_two = block_hashes([*range(12), 50, 51, 52, 53], 4)
    assert index.num_held_blocks("d0", turn_two) == 3
    assert index.num_held_blocks("d1", turn_two) == 0
    diverged = block_hashes([*range(4), 7, 7, 7, 7, *range(8, 12)], 4)
    assert index.num_held_blocks("d0", diverged) == 1  # a prefix, not a set


def test_the_index_never_holds_more_than_its_bound_and_evicts_oldest() -> None:
    index = PrefixIndex(max_entries=5)
    old, new = block_hashes(list(range(12)), 4), block_hashes(list(range(100, 112)), 4)
    index.record("d0", old)
    index.num_held_blocks("d0", old[:1])  # the first block was just used
    index.record("d1", new)
    assert len(index) == 5
    assert index.num_held_blocks("d1", new) == 3
    assert index.num_held_blocks("d0", old) == 1  # block 1 evicted, block 0 kept
    for k in range(50):
        index.record("d2", block_hashes(list(range(k, k + 8)), 4))
        assert len(index) <= 5


def test_forget_drops_one_decode_only() -> None:
    index = PrefixIndex(max_entries=100)
    hashes = block_hashes(list(range(8)), 4)
    index.record("d0", hashes)
    index.record("d1", hashes)
    index.forget("d0")
    assert index.num_held_blocks("d0", hashes) == 0
    assert index.num_held_blocks("d1", hashes) == 2


def test_the_session_header_wins_over_the_user_field() -> None:
    header = "x-session-id"
    assert session_key({header: "s1"}, {"user": "u1"}, header) == "s1"
    assert session_key({}, {"user": "u1"}, header) == "u1"
    assert session_key({}, {"user": 5}, header) is None
    assert session_key({header: ""}, {}, header) is None
    too_long = "x" * (SESSION_KEY_MAX_CHARS + 1)
    assert session_key({header: too_long}, {}, header) is None


def test_rendezvous_is_stable_and_moves_only_the_lost_decodes_sessions() -> None:
    decodes = ["decode0", "decode1", "decode2"]
    first = {s: rendezvous_order(s, decodes)[0] for s in map(str, range(300))}
    assert set(first.values()) == set(decodes)  # spread over all
    again = {s: rendezvous_order(s, list(reversed(decodes)))[0] for s in first}
    assert again == first  # order of the topology does not matter
    without = {s: rendezvous_order(s, ["decode0", "decode2"])[0] for s in first}
    moved = {s for s in first if without[s] != first[s]}
    assert moved == {s for s in first if first[s] == "decode1"}


@pytest.mark.parametrize("bad", [0, -1])
def test_bounds_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError):
        PrefixIndex(max_entries=bad)
    with pytest.raises(ValueError):
        block_hashes([1, 2], block_size=bad)
