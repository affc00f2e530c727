"""What a configuration's servers traced, read once its cluster stopped.

kvpush's connector writes ``<run_dir>/traces/*.jsonl`` (a server may flush
on the way out); vLLM's connectors write none, and every list is then
empty. A trace that cannot be read is reported and left out, never fatal.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kvpush.model.kv_size import num_layers
from kvpush_lab.bench.bandwidth import TransferSample, read_write_samples
from kvpush_lab.bench.fragment import TracedWrite, read_traced_writes
from kvpush_lab.bench.overlap import TransferTrace, read_transfers
from kvpush_lab.bench.timeline import TimelineSet, read_timelines
from kvpush_lab.bench.writes import DescriptorStats, read_write_sizes, summarize_writes


@dataclass(frozen=True)
class Traced:
    """Timelines, WRITE times, transfers against their prefill, and every
    WRITE's descriptor count."""

    timelines: TimelineSet = dataclasses.field(default_factory=TimelineSet)
    writes: list[TransferSample] = dataclasses.field(default_factory=list)
    transfers: list[TransferTrace] = dataclasses.field(default_factory=list)
    kvpush_writes: list[TracedWrite] = dataclasses.field(default_factory=list)


def read_traced(run_dir: Path, name: str, console: Console) -> Traced:
    """Everything traced under ``run_dir`` (empty when nothing was)."""
    try:
        timelines = read_timelines(run_dir)
        if not timelines:
            return Traced()
        return Traced(
            timelines,
            read_write_samples(run_dir),
            read_transfers(run_dir),
            read_traced_writes(run_dir),
        )
    except (OSError, ValueError, KeyError) as e:
        console.print(f"[bold yellow]{name}: server timelines ignored:[/] {e}")
        return Traced()


def descriptor_stats(
    run_dir: Path, model_dir: Path, console: Console
) -> DescriptorStats | None:
    """Descriptor counts of the WRITEs the configuration traced, if any."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        return summarize_writes(read_write_sizes(run_dir), num_layers(config))
    except (OSError, ValueError, KeyError) as e:
        console.print(f"[bold yellow]write sizes ignored:[/] {e}")
        return None
