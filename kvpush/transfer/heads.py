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
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.shares import HeadSlice, TpMapping

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
    return None


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
    if layers.step != 1 or layers.start < 0 or layers.stop > src.num_layers:
        raise ValueError(
            f"layers {layers} must be a step-1 range within 0..{src.num_layers}"
        )
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
    :func:`slice_descriptors`'s arrays. A group whose copy is the first
    bytes of a block (``KvLayout.copy_bytes``: a state page) is one row of
    that many bytes per block per region, whole heads only."""
    srcs, dsts, num_runs = [], [], 0
    for g, (s, d) in enumerate(zip(src_groups, dst_groups, strict=True)):
        if not s:
            continue
        block_runs = runs(s, d)
        if src.copy_bytes(g) is None:
            src_d, dst_d = slice_descriptors(block_runs, src, dst, layers, head_slice)
            num_runs += len(block_runs)
        else:  # each block a run of its own
            src_d, dst_d = _page_starts(s, d, src, dst, layers, head_slice, g)
            num_runs += len(s)
        srcs.append(src_d)
        dsts.append(dst_d)
    if len(srcs) == 1:
        return srcs[0], dsts[0], num_runs
    if not srcs:
        empty = np.empty((0, 3), dtype=np.uint64)
        return empty, empty.copy(), 0
    src_all = np.ascontiguousarray(np.concatenate(srcs))
    return src_all, np.ascontiguousarray(np.concatenate(dsts)), num_runs


def _page_starts(
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    src: KvLayout,
    dst: KvLayout,
    layers: range,
    head_slice: HeadSlice,
    group: int,
) -> tuple[Descs, Descs]:
    """The first ``KvLayout.copy_bytes(group)`` bytes of each block pair in
    each region of ``layers``: group ``group`` holds less than a block (a
    state page), copied whole between ranks of equal TP (``ValueError`` for
    another head slice or page)."""
    copy = src.copy_bytes(group)
    if copy is None or dst.copy_bytes(group) != copy or not head_slice.is_whole_block:
        raise ValueError(
            f"group {group}'s pages, copied in part, go whole to a rank of the "
            f"same heads and page bytes ({copy} and {dst.copy_bytes(group)}); "
            f"not {head_slice}"
        )
    singles = np.ones((len(src_ids), 3), dtype=np.int64)
    singles[:, 0], singles[:, 1] = src_ids, dst_ids
    src_d, dst_d = descriptors(singles, src, dst, layers)
    src_d[:, 1] = dst_d[:, 1] = copy
    return src_d, dst_d


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
