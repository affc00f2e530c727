"""The trace files a kvpush cluster leaves under ``<run_dir>/traces``.

Each connector process writes ``<engine>-<pid>.jsonl``, one JSON object per
event (:mod:`kvpush.connector.trace`); vLLM's connectors write none.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRACE_DIR = "traces"


def trace_records(run_dir: Path, events: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """Every traced record under ``run_dir`` of one of ``events`` (names such
    as ``"write_posted"``), file by file in name order; nothing when the
    configuration traced nothing."""
    folder = run_dir / TRACE_DIR
    quoted = tuple(f'"{e}"' for e in events)  # skip other lines unparsed
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for line in path.read_text().splitlines():
            if any(q in line for q in quoted):
                yield json.loads(line)
