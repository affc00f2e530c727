"""Descriptor counts of the WRITEs a configuration posted.

kvpush's connector marks every WRITE in its trace (``write_posted``, with
``num_descs``, ``num_runs`` and ``num_blocks``). Coalescing is right when
each WRITE has exactly one descriptor per maximal run of blocks contiguous
on both sides, per layer it carries: ``num_descs == num_runs * num_layers``,
with the WRITE's own ``num_layers`` from the trace (1 for a per-layer push;
the model's layers for an older trace that does not say). Pure apart from
:func:`read_write_sizes`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import msgspec

from kvpush_lab.bench.trace_files import trace_records


class WriteSize(NamedTuple):
    num_descs: int
    num_runs: int
    num_blocks: int
    num_layers: int | None = None  # the layers this WRITE carries


class DescriptorStats(msgspec.Struct, frozen=True, kw_only=True):
    """Over every WRITE of one configuration's run (warm-up included)."""

    num_writes: int
    blocks_p50: float
    runs_p50: float
    runs_max: int
    descs_p50: float
    descs_max: int
    num_layers: int
    all_one_per_run_and_layer: bool


def read_write_sizes(run_dir: Path) -> list[WriteSize]:
    """The size of every WRITE traced under ``run_dir/traces``."""
    return [
        WriteSize(
            obj["num_descs"], obj["num_runs"], obj["num_blocks"], obj.get("num_layers")
        )
        for obj in trace_records(run_dir, ("write_posted",))
    ]


def summarize_writes(
    sizes: Sequence[WriteSize], num_layers: int
) -> DescriptorStats | None:
    """Statistics of ``sizes``; None when nothing was written."""
    if not sizes:
        return None
    return DescriptorStats(
        num_writes=len(sizes),
        blocks_p50=statistics.median(s.num_blocks for s in sizes),
        runs_p50=statistics.median(s.num_runs for s in sizes),
        runs_max=max(s.num_runs for s in sizes),
        descs_p50=statistics.median(s.num_descs for s in sizes),
        descs_max=max(s.num_descs for s in sizes),
        num_layers=num_layers,
        all_one_per_run_and_layer=all(
            s.num_descs == s.num_runs * (s.num_layers or num_layers) for s in sizes
        ),
    )


def descriptor_line(name: str, stats: DescriptorStats) -> str:
    """One markdown paragraph for the report."""
    verdict = "yes" if stats.all_one_per_run_and_layer else "**no**"
    return (
        f"**{name}** posted {stats.num_writes} WRITEs: blocks per WRITE p50 "
        f"{stats.blocks_p50:g}; contiguous runs per WRITE p50 {stats.runs_p50:g} "
        f"(max {stats.runs_max}); descriptors per WRITE p50 {stats.descs_p50:g} "
        f"(max {stats.descs_max}). One descriptor per run and layer carried "
        f"(the model has {stats.num_layers} layers; a per-layer WRITE carries "
        f"one) on every WRITE: {verdict}."
    )
