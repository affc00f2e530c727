"""Block ids per KV-cache group: the shape every block list of a transfer
takes once kvpush serves vLLM's hybrid KV-cache manager.

vLLM gives a request one block table per KV-cache group (full attention,
sliding window, Mamba state), all drawn from one block pool. Index ``i``
of group ``g`` is prompt block ``i`` of that group on both sides, so a
transfer pairs ``src[g][i]`` with ``dst[g][i - first_block]`` for every
group. :func:`aligned` is the only code that makes those pairs; everything
else carries the groups as they are. A model with one group (dense, MoE,
MLA) has a tuple of one list.

The null block: vLLM's block pool hands out block :data:`NULL_BLOCK` (id 0)
to no request; a table holds it where a group keeps no block (the prompt
blocks a sliding window has left, on either side). :func:`aligned` pairs
only the prompt blocks decode keeps (a real destination id) and refuses a
pair whose source prefill no longer holds; no other code decides which
blocks a transfer carries. Null ids are never pinned, held or written.
"""

from __future__ import annotations

from collections.abc import Sequence

Blocks = tuple[int, ...]
GroupBlocks = tuple[Blocks, ...]
Groups = Sequence[Sequence[int]]  # any per-group sequences (read only)

NULL_BLOCK = 0  # vLLM's null block: in a table, "no block kept here"


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


def real(groups: Groups) -> Blocks:
    """Every group's ids less the null block, in group order: the blocks a
    request really holds (what is pinned, held in the ledger, or lost)."""
    return tuple(b for g in groups for b in g if b != NULL_BLOCK)


def span(groups: Groups, start: int, end: int) -> GroupBlocks:
    """Prompt blocks ``start`` to ``end`` (exclusive) of every group."""
    return tuple(tuple(g[start:end]) for g in groups)


def distinct_problem(groups: GroupBlocks) -> str | None:
    """Why these groups cannot be one request's blocks (a real id twice, in
    one group or two: the groups share one pool), or None."""
    ids = real(groups)
    if len(set(ids)) != len(ids):
        return "a block id repeats among the groups' block lists"
    return None


def aligned(
    src: Groups, dst: Groups, start: int, end: int, first_block: int
) -> tuple[GroupBlocks, GroupBlocks]:
    """The pairs of prompt blocks ``start`` to ``end`` (exclusive) that
    decode keeps: per group, the source id of each such block and the
    destination id decode registered for it (``dst[g][i]`` is prompt block
    ``first_block + i``), leaving out blocks whose destination is the null
    block (decode's window does not read them). ``ValueError`` when the
    group counts differ, the span begins before ``first_block``, a group is
    too short for it, or prefill's source of a block decode keeps is the
    null block (it was let go: the KV decode would read is not there)."""
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
    pairs = [
        [(s, d) for s, d in zip(g_src, g_dst, strict=True) if d != NULL_BLOCK]
        for g_src, g_dst in zip(
            span(src, start, end),
            span(dst, start - first_block, end - first_block),
            strict=True,
        )
    ]
    for g, group in enumerate(pairs):
        if any(s == NULL_BLOCK for s, _ in group):
            raise ValueError(
                f"group {g}: decode keeps a prompt block of {start}..{end} "
                "that prefill no longer holds (its source is the null block)"
            )
    return (
        tuple(tuple(s for s, _ in group) for group in pairs),
        tuple(tuple(d for _, d in group) for group in pairs),
    )


def prompt_view(
    tables: Groups, is_state: Sequence[bool], num_blocks: int
) -> GroupBlocks:
    """vLLM's tables (one per group) as prompt blocks ``0..num_blocks-1``.

    A state group (Mamba: one block a request, holding the state after the
    tokens computed so far) stands as prompt block ``num_blocks - 1``, the
    null block before it: only a span that completes the prompt pairs it,
    so it goes once, with the last block, after the last chunk's forward.
    Other groups are as vLLM keeps them. ``ValueError`` for a state group
    that does not hold exactly one real block."""
    if len(tables) != len(is_state):
        raise ValueError(f"{len(tables)} tables for {len(is_state)} groups")
    view = []
    for g, (table, state) in enumerate(zip(tables, is_state, strict=True)):
        if not state:
            view.append(tuple(table))
            continue
        held = [b for b in table if b != NULL_BLOCK]
        if len(held) != 1 or num_blocks < 1:
            raise ValueError(
                f"state group {g} holds {len(held)} blocks; kvpush copies one"
            )
        view.append((NULL_BLOCK,) * (num_blocks - 1) + (held[0],))
    return tuple(view)
