"""BASELINE FOR MEASUREMENT ONLY: the pure-Python descriptor build that
:mod:`kvpush.transfer.coalesce` used before it was vectorised with numpy
(commit 56f2390 and earlier), copied here so ``kvpush bench-micro`` can time
the old against the new on the same input. No production code imports this
module; validation is left out (the new code's is unchanged and cheap).

Output: lists of ``(addr, length, device_id)`` tuples, as the old
``NixlIO.write`` handed them to ``get_xfer_descs`` after converting each
``Desc`` with ``tuple(d)`` (:func:`as_tuples`, the last step timed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvpush.transfer.layout import KvLayout


class OldRun(NamedTuple):
    src_start: int
    dst_start: int
    length: int


class OldDesc(NamedTuple):
    addr: int
    length: int
    device_id: int


def old_runs(src: Sequence[int], dst: Sequence[int]) -> list[OldRun]:
    """The old run detection, validation included (it was part of the cost)."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    if any(b < 0 for b in src) or any(b < 0 for b in dst):
        raise ValueError("block ids must be non-negative")
    if len(set(dst)) != len(dst):
        raise ValueError("destination block ids must not repeat")
    out: list[OldRun] = []
    for s, d in zip(src, dst, strict=True):
        if out:
            last = out[-1]
            if s == last.src_start + last.length and d == last.dst_start + last.length:
                out[-1] = last._replace(length=last.length + 1)
                continue
        out.append(OldRun(s, d, 1))
    return out


def old_descriptors(
    block_runs: Sequence[OldRun], src: KvLayout, dst: KvLayout, layers: range
) -> tuple[list[OldDesc], list[OldDesc]]:
    """The old triple loop: layer, region, run (range checks included)."""
    for run in block_runs:
        if run.length < 1 or run.src_start < 0 or run.dst_start < 0:
            raise ValueError(f"invalid run {run}")
        if run.src_start + run.length > src.num_blocks:
            raise ValueError(f"{run} reads past the source")
        if run.dst_start + run.length > dst.num_blocks:
            raise ValueError(f"{run} writes past the destination")
    src_descs: list[OldDesc] = []
    dst_descs: list[OldDesc] = []
    for layer in layers:
        for src_region, dst_region in zip(
            src.regions(layer), dst.regions(layer), strict=True
        ):
            for run in block_runs:
                nbytes = run.length * src.block_bytes
                src_descs.append(
                    OldDesc(
                        src.block_addr(src_region, run.src_start),
                        nbytes,
                        src.device_id,
                    )
                )
                dst_descs.append(
                    OldDesc(
                        dst.block_addr(dst_region, run.dst_start),
                        nbytes,
                        dst.device_id,
                    )
                )
    return src_descs, dst_descs


def as_tuples(descs: Sequence[OldDesc]) -> list[tuple[int, ...]]:
    """What the old ``NixlIO.write`` passed to ``get_xfer_descs``."""
    return [tuple(d) for d in descs]
