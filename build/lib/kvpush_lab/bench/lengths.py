"""Length distributions for prompts and outputs, written as short strings.

``"1000"`` is a fixed length, ``"500-1500"`` (or ``"uniform:500-1500"``) a
uniform integer range, and ``"trace:FILE.jsonl"`` replays the lengths of a
JSONL trace in file order, one line per request (see :func:`read_trace`).
Pure apart from :func:`read_trace`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import Literal

LengthKind = Literal["fixed", "uniform", "trace"]
TRACE_KEYS = ("prompt_len", "output_len")


@dataclass(frozen=True)
class LengthSpec:
    """One length distribution; ``low``/``high`` unused for traces."""

    kind: LengthKind
    low: int = 0
    high: int = 0
    path: Path | None = None

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        """Parse ``"N"``, ``"A-B"``, ``"uniform:A-B"`` or ``"trace:FILE"``."""
        text = str(text).strip()
        if text.startswith("trace:"):
            path = text.removeprefix("trace:").strip()
            if not path:
                raise ValueError("a trace length needs a file: 'trace:FILE.jsonl'")
            return cls(kind="trace", path=Path(path).expanduser())
        body = text.removeprefix("uniform:")
        parts = body.split("-")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) == 1 and body == text:
            spec = cls(kind="fixed", low=numbers[0], high=numbers[0])
        elif len(numbers) == 2:
            spec = cls(kind="uniform", low=numbers[0], high=numbers[1])
        else:
            raise ValueError(
                f"length {text!r} is not 'N', 'A-B', 'uniform:A-B' or 'trace:FILE'"
            )
        if spec.low < 1 or spec.high < spec.low:
            raise ValueError(
                f"length {text!r} needs 1 <= low <= high; e.g. '1000' or '500-1500'"
            )
        return spec

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"uniform {self.low}-{self.high}"
        return f"trace {self.path}"

    @property
    def max_value(self) -> int | None:
        """The largest length it can produce (None: depends on the trace)."""
        return None if self.kind == "trace" else self.high

    def sample(self, num: int, rng: Random, trace: Sequence[int] = ()) -> list[int]:
        """``num`` lengths. Traces replay ``trace`` in order, wrapping around."""
        if self.kind == "fixed":
            return [self.low] * num
        if self.kind == "uniform":
            return [rng.randint(self.low, self.high) for _ in range(num)]
        if not trace:
            raise ValueError(f"trace {self.path} holds no lengths")
        return [trace[i % len(trace)] for i in range(num)]


def read_trace(path: Path, key: str) -> list[int]:
    """The ``key`` values (``prompt_len`` or ``output_len``) of a JSONL trace.

    Each non-empty line is an object such as
    ``{"prompt_len": 812, "output_len": 64}``; other keys are ignored.
    """
    if key not in TRACE_KEYS:
        raise ValueError(f"trace key must be one of {TRACE_KEYS}, not {key!r}")
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read length trace {path}: {e}") from e
    values = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)[key]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}:{number}: each line must be a JSON object with an "
                f"integer {key!r} ({e})"
            ) from e
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}:{number}: {key} must be an integer >= 1")
        values.append(value)
    if not values:
        raise ValueError(f"length trace {path} has no lines")
    return values
