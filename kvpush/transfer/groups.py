"""Block ids per KV-cache group: the shape every block list of a transfer
takes once kvpush serves vLLM's hybrid KV-cache manager.

vLLM gives a request one block table per KV-cache group (full attention,
sliding window, Mamba state), all drawn from one block pool. Index ``i``
of group ``g`` is prompt block ``i`` of that group on both sides, so a
transfer pairs ``src[g][i]`` with ``dst[g][i - first_block]`` for every
group. :func:`aligned` is the only code that makes those pairs; everything
else carries the groups as they are. A model with one group (today's:
dense, MoE, MLA) has a tuple of one list.
"""

from __future__ import annotations

from collections.abc import Sequence

Blocks = tuple[int, ...]
GroupBlocks = tuple[Blocks, ...]
Groups = Sequence[Sequence[int]]  # any per-group sequences (read only)


def one(block_ids: Sequence[int]) -> GroupBlocks:
    """The block list of a one-group model."""
    return (tuple(block_ids),)


def of(groups: Sequence[Sequence[int]]) -> GroupBlocks:
    """Any per-group sequences, as :data:`GroupBlocks`."""
    return tuple(tuple(g) for g in groups)


def flat(groups: GroupBlocks) -> Blocks:
    """Every group's ids, in group order (the blocks a transfer holds)."""
    return tuple(b for g in groups for b in g)


def total(groups: GroupBlocks) -> int:
    """How many block ids the groups hold together."""
    return sum(len(g) for g in groups)


def span(groups: Groups, start: int, end: int) -> GroupBlocks:
    """Prompt blocks ``start`` to ``end`` (exclusive) of every group."""
    return tuple(tuple(g[start:end]) for g in groups)


def distinct_problem(groups: GroupBlocks) -> str | None:
    """Why these groups cannot be one request's blocks (an id twice, in
    one group or two: the groups share one pool), or None."""
    ids = flat(groups)
    if len(set(ids)) != len(ids):
        return "a block id repeats among the groups' block lists"
    return None


def aligned(
    src: Groups, dst: Groups, start: int, end: int, first_block: int
) -> tuple[GroupBlocks, GroupBlocks]:
    """The pairs of prompt blocks ``start`` to ``end`` (exclusive): the
    source ids of those blocks and, for each, the destination id decode
    registered for it (``dst[g][i]`` is prompt block ``first_block + i``).
    ``ValueError`` when the group counts differ, the span begins before
    ``first_block``, or a group is too short for it."""
    if len(src) != len(dst) or not src:
        raise ValueError(
            f"{len(src)} source and {len(dst)} destination groups cannot pair"
        )
    if not first_block <= start <= end:
        raise ValueError(
            f"prompt blocks {start}..{end} are not all at or after "
            f"decode's first block {first_block}"
        )
    for g, (s, d) in enumerate(zip(src, dst, strict=True)):
        if len(s) < end or len(d) < end - first_block:
            raise ValueError(
                f"group {g} holds {len(s)} source and {len(d)} destination "
                f"blocks; prompt blocks {start}..{end} need {end} and "
                f"{end - first_block}"
            )
    return (
        span(src, start, end),
        span(dst, start - first_block, end - first_block),
    )
