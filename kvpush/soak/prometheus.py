"""Samples of a Prometheus text exposition (what ``/metrics`` serves): pure.

Only what the soak needs: each sample line's metric name, labels (escapes
undone) and value; comments, and lines that do not parse, are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


@dataclass(frozen=True)
class Sample:
    """One line of the exposition: metric name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments skipped)."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        found = {k: _unescape(v) for k, v in _LABEL.findall(labels or "")}
        samples.append(Sample(name, found, number))
    return samples


def _unescape(value: str) -> str:
    """Undo the exposition's escapes: ``\\\\``, ``\\"`` and ``\\n``."""
    return _ESCAPE.sub(lambda m: "\n" if m[1] == "n" else m[1], value)
