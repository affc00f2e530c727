"""Turn block-id pairs into as few memory descriptors as possible.

The prefill side's writer calls :func:`runs` once per work item and
:func:`descriptors` to get the two descriptor arrays for one NIXL WRITE.
Block ``src[i]`` is copied to block ``dst[i]``; a *run* is a maximal stretch
of pairs where both ``src`` and ``dst`` go up by exactly one, so the whole
stretch is one contiguous copy in every region (see
:mod:`kvpush.transfer.layout`). With block size 16 and a fragmented cache the
difference is thousands of descriptors against a handful, and the post call
scales with the count.

Both are vectorised with numpy: an 80-layer, 1000-block fragmented WRITE is
160,000 descriptors per side, which Python loops took 100+ ms to build on the
thread that shares the GIL with the model runner. Both functions are pure
and own nothing; the returned arrays belong to the caller.

* runs are an ``(R, 3)`` int64 array, one :class:`Run` per row
  (``src_start, dst_start, length``);
* descriptors are a C-contiguous ``(N, 3)`` uint64 array, one :class:`Desc`
  per row (``addr, length, device_id``), the shape NIXL's ``get_xfer_descs``
  takes without copying (uint64: addresses may exceed ``2**63``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from kvpush.transfer.layout import KvLayout

Runs: TypeAlias = npt.NDArray[np.int64]
"""``(R, 3)`` int64: one run per row, columns as in :class:`Run`."""
Descs: TypeAlias = npt.NDArray[np.uint64]
"""``(N, 3)`` uint64, C-contiguous: one descriptor per row, as :class:`Desc`."""


class Run(NamedTuple):
    """One row of :data:`Runs`: ``length`` blocks from ``src_start`` copied
    to ``dst_start`` onwards."""

    src_start: int
    dst_start: int
    length: int


class Desc(NamedTuple):
    """One row of :data:`Descs`: one contiguous memory range, as NIXL takes it."""

    addr: int
    length: int
    device_id: int


def runs(src: Sequence[int], dst: Sequence[int]) -> Runs:
    """Maximal runs contiguous on both sides, in the order of the pairs.

    ``ValueError`` when the lengths differ, an id is negative, or a
    destination id repeats (two sources would race for one block). Sources
    may repeat; they are only read."""
    s = np.asarray(src, dtype=np.int64).reshape(-1)
    d = np.asarray(dst, dtype=np.int64).reshape(-1)
    if s.size != d.size:
        raise ValueError(f"{s.size} source blocks but {d.size} destination blocks")
    if s.size == 0:
        return np.empty((0, 3), dtype=np.int64)
    if s.min() < 0 or d.min() < 0:
        raise ValueError("block ids must be non-negative")
    if np.unique(d).size != d.size:
        raise ValueError("destination block ids must not repeat")
    breaks = (np.diff(s) != 1) | (np.diff(d) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(np.append(starts, s.size))
    return np.column_stack((s[starts], d[starts], lengths))


def descriptors(
    block_runs: Runs | Sequence[Run],
    src_layout: KvLayout,
    dst_layout: KvLayout,
    layers: range,
) -> tuple[Descs, Descs]:
    """Source and destination descriptors for ``block_runs`` in ``layers``.

    The arrays are parallel (row ``i`` of ``src`` is copied to row ``i`` of
    ``dst``), ordered layer by layer, then region, then run:
    ``len(layers) * regions_per_layer * len(block_runs)`` rows each.
    ``ValueError`` when the layouts' block shapes differ or a layer or block
    is out of range."""
    table = np.asarray(block_runs, dtype=np.int64).reshape(-1, 3)
    _check_layouts(src_layout, dst_layout, layers)
    _check_runs(table, src_layout, dst_layout)
    num_regions = len(layers) * src_layout.regions_per_layer
    # One allocation for both sides: a large fresh buffer is mostly page
    # faults, and two half-size ones cost ten times one (numpy asks for huge
    # pages from 4 MiB up; a fragmented 80-layer WRITE is 2 x 3.8 MB).
    out = np.empty((2, num_regions, len(table), 3), dtype=np.uint64)
    nbytes = (table[:, 2] * src_layout.block_bytes).astype(np.uint64)
    _fill(out[0], src_layout, layers, table[:, 0], nbytes)
    _fill(out[1], dst_layout, layers, table[:, 1], nbytes)
    return out[0].reshape(-1, 3), out[1].reshape(-1, 3)


def desc_list(descs: Descs | Sequence[Desc]) -> list[Desc]:
    """``descs`` as a list of :class:`Desc` (for tests and logs; slow)."""
    rows = np.asarray(descs, dtype=np.uint64).reshape(-1, 3).tolist()
    return [Desc(*row) for row in rows]


def _fill(
    out: npt.NDArray[np.uint64],
    layout: KvLayout,
    layers: range,
    starts: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.uint64],
) -> None:
    """One side's descriptors into ``out`` (regions x runs x 3): every region
    of ``layers`` times every run."""
    rpl = layout.regions_per_layer
    bases = layout.base_addrs[layers.start * rpl : layers.stop * rpl]
    base = np.asarray(bases, dtype=np.uint64)
    offsets = (starts * layout.block_bytes).astype(np.uint64)
    np.add(base[:, None], offsets[None, :], out=out[:, :, 0])
    out[:, :, 1] = nbytes
    out[:, :, 2] = layout.device_id


def _check_layouts(src: KvLayout, dst: KvLayout, layers: range) -> None:
    if src.block_bytes != dst.block_bytes:
        raise ValueError(
            f"block sizes differ: source {src.block_bytes} B, "
            f"destination {dst.block_bytes} B"
        )
    if src.regions_per_layer != dst.regions_per_layer:
        raise ValueError("source and destination split layers into different regions")
    limit = min(src.num_layers, dst.num_layers)
    if layers.step != 1 or layers.start < 0 or layers.stop > limit:
        raise ValueError(f"layers {layers} must be a step-1 range within 0..{limit}")


def _check_runs(table: Runs, src: KvLayout, dst: KvLayout) -> None:
    """``ValueError`` naming the first bad run and the first rule it breaks."""
    s, d, n = table[:, 0], table[:, 1], table[:, 2]
    invalid = (n < 1) | (s < 0) | (d < 0)
    reads_past = s + n > src.num_blocks
    writes_past = d + n > dst.num_blocks
    bad = invalid | reads_past | writes_past
    if not bad.any():
        return
    i = int(np.argmax(bad))
    run = Run(*table[i].tolist())
    if invalid[i]:
        raise ValueError(f"invalid run {run}")
    if reads_past[i]:
        raise ValueError(f"{run} reads past the source's {src.num_blocks} blocks")
    raise ValueError(f"{run} writes past the destination's {dst.num_blocks} blocks")
