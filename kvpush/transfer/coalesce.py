"""Turn block-id pairs into as few memory descriptors as possible.

The prefill side's writer calls :func:`runs` once per work item and
:func:`descriptors` to get the two descriptor lists for one NIXL WRITE. Block
``src[i]`` is copied to block ``dst[i]``; a *run* is a maximal stretch of
pairs where both ``src`` and ``dst`` go up by exactly one, so the whole
stretch is one contiguous copy in every region (see
:mod:`kvpush.transfer.layout`). With block size 16 and a fragmented cache the
difference is thousands of descriptors against a handful, and the post call
scales with the count.

Both functions are pure and own nothing; the returned lists belong to the
caller. Descriptors are ``(addr, length, device_id)`` tuples, the shape NIXL's
``get_xfer_descs`` accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvpush.transfer.layout import KvLayout


class Run(NamedTuple):
    """``length`` blocks from ``src_start`` copied to ``dst_start`` onwards."""

    src_start: int
    dst_start: int
    length: int


class Desc(NamedTuple):
    """One contiguous memory range, as NIXL takes it."""

    addr: int
    length: int
    device_id: int


def runs(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Maximal runs contiguous on both sides, in the order of the pairs.

    ``ValueError`` when the lengths differ, an id is negative, or a
    destination id repeats (two sources would race for one block). Sources
    may repeat; they are only read."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    if any(b < 0 for b in src) or any(b < 0 for b in dst):
        raise ValueError("block ids must be non-negative")
    if len(set(dst)) != len(dst):
        raise ValueError("destination block ids must not repeat")
    out: list[Run] = []
    for s, d in zip(src, dst, strict=True):
        if out:
            last = out[-1]
            if s == last.src_start + last.length and d == last.dst_start + last.length:
                out[-1] = last._replace(length=last.length + 1)
                continue
        out.append(Run(s, d, 1))
    return out


def descriptors(
    block_runs: Sequence[Run],
    src_layout: KvLayout,
    dst_layout: KvLayout,
    layers: range,
) -> tuple[list[Desc], list[Desc]]:
    """Source and destination descriptors for ``block_runs`` in ``layers``.

    The lists are parallel (``src[i]`` is copied to ``dst[i]``, same length),
    ordered layer by layer, then region, then run: ``len(layers) *
    regions_per_layer * len(block_runs)`` descriptors each. ``ValueError``
    when the layouts' block shapes differ or a layer or block is out of
    range."""
    _check_layouts(src_layout, dst_layout, layers)
    for run in block_runs:
        _check_run(run, src_layout, dst_layout)
    src_descs: list[Desc] = []
    dst_descs: list[Desc] = []
    for layer in layers:
        for src_region, dst_region in zip(
            src_layout.regions(layer), dst_layout.regions(layer), strict=True
        ):
            for run in block_runs:
                nbytes = run.length * src_layout.block_bytes
                src_descs.append(
                    Desc(
                        src_layout.block_addr(src_region, run.src_start),
                        nbytes,
                        src_layout.device_id,
                    )
                )
                dst_descs.append(
                    Desc(
                        dst_layout.block_addr(dst_region, run.dst_start),
                        nbytes,
                        dst_layout.device_id,
                    )
                )
    return src_descs, dst_descs


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


def _check_run(run: Run, src: KvLayout, dst: KvLayout) -> None:
    if run.length < 1 or run.src_start < 0 or run.dst_start < 0:
        raise ValueError(f"invalid run {run}")
    if run.src_start + run.length > src.num_blocks:
        raise ValueError(f"{run} reads past the source's {src.num_blocks} blocks")
    if run.dst_start + run.length > dst.num_blocks:
        raise ValueError(f"{run} writes past the destination's {dst.num_blocks} blocks")
