"""Where one (prefill rank, decode rank) pair's KV heads and state pieces
lie in memory: NIXL descriptors for a WRITE.

Which pairs exist and which heads each carries is
:class:`~kvpush.transfer.shares.TpMapping`'s; this module turns one pair's
:class:`~kvpush.transfer.shares.HeadSlice` and block runs into descriptors
(:func:`slice_descriptors`, :func:`group_descriptors`).

Bytes: in vLLM's LBHNC layout a block of one region is ``[heads][tokens]
[K|V or head_size]``, so heads ``[h0, h1)`` of a block are the one range at
``h0 * head_bytes`` of ``(h1 - h0) * head_bytes``, ``head_bytes`` being
``block_bytes`` over that rank's heads. :class:`KvLayout` does not record the
interior order; the caller names it to :func:`head_split_problem`, which
refuses layouts (NHD-style) whose heads cannot be split so. MLA's latent
cache is one "head" every rank holds whole (``total_kv_heads`` 1), so its
pairs copy whole blocks and never split.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvpush.transfer.coalesce import Descs, Run, Runs, descriptors, runs
from kvpush.transfer.groups import GroupBlocks
from kvpush.transfer.layout import KvLayout, groups_problem
from kvpush.transfer.shares import HeadSlice, TpMapping
from kvpush.transfer.state_pages import Pieces

HEAD_SEPARABLE_LAYOUTS = frozenset({"LBHNC"})
"""Interior orders in which a block's heads are outermost (one range each)."""


def head_split_problem(mapping: TpMapping, cache_layout: str) -> str | None:
    """Why KV cannot be pushed under ``mapping``, or ``None`` when it can.

    ``cache_layout`` names the interior order of a block of one region
    (vLLM's ``VLLM_KV_CACHE_LAYOUT`` names, see
    :mod:`kvpush.connector.kv_memory`); pass ``"LBHNC"`` only where heads are
    outermost in each region's block. Called once at start-up and per Hello.
    Whole-block mappings need no split, so only heterogeneous ones fail."""
    if mapping.splits_heads and cache_layout not in HEAD_SEPARABLE_LAYOUTS:
        return (
            f"KV cache layout {cache_layout!r} interleaves heads inside each "
            f"token (NHD-style), so one rank's heads are not one range per block; "
            f"prefill TP {mapping.prefill_tp} to decode TP {mapping.decode_tp} "
            f"needs VLLM_KV_CACHE_LAYOUT=LBHNC or equal TP sizes"
        )
    return None


def slice_problem(src: KvLayout, dst: KvLayout, head_slice: HeadSlice) -> str | None:
    """Why ``head_slice`` cannot be copied between ``src``'s and ``dst``'s
    blocks, or ``None``: the per-rank counterpart of
    :func:`~kvpush.transfer.layout.compat_problem`, where block bytes may
    differ but the bytes of one head of one block may not."""
    for field in ("block_size", "regions_per_layer", "kv_dtype", "num_layers"):
        mine, theirs = getattr(src, field), getattr(dst, field)
        if mine != theirs:
            return f"{field} differs: source {mine!r}, destination {theirs!r}"
    src_heads, dst_heads = head_slice.src.num_heads, head_slice.dst.num_heads
    if src.block_bytes % src_heads or dst.block_bytes % dst_heads:
        return (
            f"block bytes {src.block_bytes} and {dst.block_bytes} do not split into "
            f"{src_heads} and {dst_heads} equal heads"
        )
    if src.block_bytes // src_heads != dst.block_bytes // dst_heads:
        return (
            f"bytes per head per block differ: source {src.block_bytes // src_heads}"
            f" ({src_heads} heads), destination {dst.block_bytes // dst_heads} "
            f"({dst_heads} heads)"
        )
    return groups_problem(src, dst)


def slice_descriptors(
    block_runs: Runs | Sequence[Run],
    src: KvLayout,
    dst: KvLayout,
    layers: range,
    head_slice: HeadSlice,
) -> tuple[Descs, Descs]:
    """Source and destination descriptors copying ``head_slice``'s heads of
    ``block_runs`` in ``layers``, ordered layer, region, then run or block.

    A whole-block slice is :func:`~kvpush.transfer.coalesce.descriptors`: one
    row per run per region. A partial one is one row per block per region
    (the side with more heads holds the slice of consecutive blocks apart).
    ``ValueError`` as :func:`slice_problem` says, or for a layer or block out
    of range."""
    problem = slice_problem(src, dst, head_slice)
    if problem is not None:
        raise ValueError(problem)
    if head_slice.is_whole_block:
        return descriptors(block_runs, src, dst, layers)
    _check_layers(layers, src)
    src_ids, dst_ids = _blocks(np.asarray(block_runs, dtype=np.int64), src, dst)
    head_bytes = src.block_bytes // head_slice.src.num_heads
    num_regions = len(layers) * src.regions_per_layer
    out = np.empty((2, num_regions, src_ids.size, 3), dtype=np.uint64)
    nbytes = head_slice.num_heads * head_bytes
    _fill(out[0], src, layers, src_ids, head_slice.src_heads.start * head_bytes)
    _fill(out[1], dst, layers, dst_ids, head_slice.dst_heads.start * head_bytes)
    out[:, :, :, 1] = nbytes
    return out[0].reshape(-1, 3), out[1].reshape(-1, 3)


def group_descriptors(
    src_groups: GroupBlocks,
    dst_groups: GroupBlocks,
    src: KvLayout,
    dst: KvLayout,
    layers: range,
    head_slice: HeadSlice,
) -> tuple[Descs, Descs, int]:
    """:func:`slice_descriptors` for each KV-cache group's pairs
    (:mod:`kvpush.transfer.groups`), in group order, as one WRITE's two
    arrays, and how many block runs they hold. One group gives exactly
    :func:`slice_descriptors`'s arrays. A state group (``KvLayout.copy_bytes``
    set) copies :func:`state_pieces` of each block in each region."""
    srcs, dsts, num_runs = [], [], 0
    for g, (s, d) in enumerate(zip(src_groups, dst_groups, strict=True)):
        if not s:
            continue
        if src.copy_bytes(g) is None:
            block_runs = runs(s, d)
            src_d, dst_d = slice_descriptors(block_runs, src, dst, layers, head_slice)
            num_runs += len(block_runs)
        else:  # each block a run of its own
            src_d, dst_d = _state_descriptors(s, d, src, dst, layers, head_slice, g)
            num_runs += len(s) if len(src_d) else 0
        srcs.append(src_d)
        dsts.append(dst_d)
    if len(srcs) == 1:
        return srcs[0], dsts[0], num_runs
    if not srcs:
        empty = np.empty((0, 3), dtype=np.uint64)
        return empty, empty.copy(), 0
    src_all = np.ascontiguousarray(np.concatenate(srcs))
    return src_all, np.ascontiguousarray(np.concatenate(dsts)), num_runs


def state_pieces(layout: KvLayout, group: int, head_slice: HeadSlice) -> Pieces:
    """What ``head_slice``'s pair copies of each of state group ``group``'s
    pages: its described page's pieces
    (:meth:`~kvpush.transfer.state_pages.StatePage.pieces`), or, where the
    page is not described, its first ``KvLayout.copy_bytes`` bytes whole,
    between ranks of the same heads only (``ValueError`` otherwise)."""
    page = layout.state_page(group)
    src, dst = head_slice.src, head_slice.dst
    if page is not None:
        return page.pieces(src.tp_size, src.tp_rank, dst.tp_size, dst.tp_rank)
    copy = layout.copy_bytes(group)
    if copy is None or not head_slice.is_whole_block or src.tp_size != dst.tp_size:
        raise ValueError(
            f"group {group}'s pages are not described, so they copy whole "
            f"between equal TP sizes only; not {head_slice}"
        )
    return np.asarray([[0, 0, copy]], dtype=np.int64)


def _state_descriptors(
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    src: KvLayout,
    dst: KvLayout,
    layers: range,
    head_slice: HeadSlice,
    group: int,
) -> tuple[Descs, Descs]:
    """:func:`state_pieces` of each block pair in each region of ``layers``
    (none where the pair carries none of the state)."""
    _check_layers(layers, src)
    pieces = state_pieces(src, group, head_slice)
    if dst.state_page(group) != src.state_page(group):
        raise ValueError(f"group {group}'s state pages differ between the sides")
    table = np.ones((len(src_ids), 3), dtype=np.int64)
    table[:, 0], table[:, 1] = src_ids, dst_ids
    src_ids_a, dst_ids_a = _blocks(table, src, dst)
    out = []
    for ids, layout, column in ((src_ids_a, src, 0), (dst_ids_a, dst, 1)):
        starts = np.empty(
            (len(layers) * layout.regions_per_layer, ids.size, 3), np.uint64
        )
        _fill(starts, layout, layers, ids, 0)  # page starts, region then block
        rows = np.repeat(starts.reshape(-1, 3), len(pieces), axis=0)
        count = len(rows) // len(pieces) if len(pieces) else 0
        rows[:, 0] += np.tile(pieces[:, column].astype(np.uint64), count)
        rows[:, 1] = np.tile(pieces[:, 2].astype(np.uint64), count)
        out.append(rows)
    return out[0], out[1]


def _check_layers(layers: range, layout: KvLayout) -> None:
    if layers.step != 1 or layers.start < 0 or layers.stop > layout.num_layers:
        raise ValueError(
            f"layers {layers} must be a step-1 range within 0..{layout.num_layers}"
        )


def _blocks(
    table: npt.NDArray[np.int64], src: KvLayout, dst: KvLayout
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Runs expanded to (source ids, destination ids), one per block."""
    table = table.reshape(-1, 3)
    lengths = table[:, 2]
    if (lengths < 1).any() or (table[:, :2] < 0).any():
        raise ValueError("runs need ids >= 0 and lengths >= 1")
    within = np.arange(int(lengths.sum())) - np.repeat(
        np.cumsum(lengths) - lengths, lengths
    )
    src_ids = np.repeat(table[:, 0], lengths) + within
    dst_ids = np.repeat(table[:, 1], lengths) + within
    if src_ids.size and src_ids.max() >= src.num_blocks:
        raise ValueError(f"a run reads past the source's {src.num_blocks} blocks")
    if dst_ids.size and dst_ids.max() >= dst.num_blocks:
        raise ValueError(f"a run writes past the destination's {dst.num_blocks} blocks")
    if np.unique(dst_ids).size != dst_ids.size:
        raise ValueError("destination block ids must not repeat")
    return src_ids, dst_ids


def _fill(
    out: npt.NDArray[np.uint64],
    layout: KvLayout,
    layers: range,
    block_ids: npt.NDArray[np.int64],
    offset: int,
) -> None:
    """Addresses (regions x blocks) of the slice at ``offset`` in each block."""
    rpl = layout.regions_per_layer
    base = np.asarray(
        layout.base_addrs[layers.start * rpl : layers.stop * rpl], dtype=np.uint64
    )
    within = (block_ids * layout.block_bytes + offset).astype(np.uint64)
    np.add(base[:, None], within[None, :], out=out[:, :, 0])
    out[:, :, 2] = layout.device_id
