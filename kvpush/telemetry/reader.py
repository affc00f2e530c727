"""One ``/metrics`` text, parsed, and its samples looked up by name and labels.

Every reader of a Prometheus text exposition in kvpush (the router's load
signals and connector events, the bench's meters, the soak's leak check,
the tests) parses it with :meth:`Exposition.parse`, on
``prometheus_client``'s own parser, then asks for samples:

- by :class:`~kvpush.telemetry.names.Family` (a counter's ``_total``
  samples, a gauge's; a histogram's through its ``.count``, ``.sum`` and
  ``.bucket``), which also checks the labels asked for against the
  family's; or by sample name, a string, where the name of a counter family
  finds its ``_total`` samples (the parser names a counter's family
  without that suffix);
- filtered by labels (a sample matches when its labels include them all),
  and summed over the others: vLLM serves one sample per engine.

prometheus_client's details, handled here once: a counter's ``_created``
samples are a gauge family of their own and never count as its value;
label values come unescaped (``\\"``, ``\\\\``, ``\\n``); values are floats
(the parser gives ``3`` as an int); a ``NaN`` sample is listed by
:meth:`Exposition.samples` but left out of every sum, maximum and grouping
(an unset value is unknown, not a number). A text that does not parse
raises ``ValueError`` naming its first bad line, never half a reading.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvpush.telemetry.names import Family, Kind

Name = str | Family  # a sample name, or a family (see the module docstring)
BUCKET_BOUND = "le"  # the label of a histogram bucket's upper bound


@dataclass(frozen=True)
class Sample:
    """One sample of the exposition: its name, labels and value."""

    name: str
    labels: Mapping[str, str]
    value: float

    def has(self, labels: Mapping[str, str]) -> bool:
        """Whether its labels include ``labels``."""
        return all(self.labels.get(k) == v for k, v in labels.items())


class Exposition:
    """The samples of one ``/metrics`` text, by name; and its families' types."""

    def __init__(self, samples: Iterable[Sample], kinds: Mapping[str, str]) -> None:
        self._by_name: dict[str, list[Sample]] = {}
        for sample in samples:
            self._by_name.setdefault(sample.name, []).append(sample)
        self.kinds: dict[str, str] = dict(kinds)  # family name -> its # TYPE

    @classmethod
    def parse(cls, text: str) -> Exposition:
        """Parse a Prometheus text exposition (``ValueError`` if it does not)."""
        try:
            families = list(text_string_to_metric_families(text))
        except (ValueError, IndexError) as e:  # IndexError: some bad label lists
            raise ValueError(_parse_error(text, e)) from e
        samples = [
            Sample(s.name, dict(s.labels), float(s.value))
            for family in families
            for s in family.samples
        ]
        return cls(samples, {f.name: f.type for f in families})

    def samples(self, name: Name, **labels: str) -> list[Sample]:
        """The samples called ``name`` whose labels include ``labels`` (NaN too)."""
        _check_labels(name, labels)
        found = self._by_name.get(self._sample_name(name), [])
        return [s for s in found if s.has(labels)]

    def total(self, name: Name, **labels: str) -> float | None:
        """The sum of those samples (over vLLM's engines, say); None if none."""
        values = self._values(name, labels)
        return sum(values) if values else None

    def highest(self, name: Name, **labels: str) -> float | None:
        """The largest of those samples (the fullest engine, say); None if none."""
        return max(self._values(name, labels), default=None)

    def by_label(self, name: Name, label: str, **labels: str) -> dict[str, float]:
        """Those samples summed per value of ``label`` (samples without it,
        or with it empty, left out)."""
        grouped = self.by_labels(name, (label,), **labels)
        return {key[0]: value for key, value in grouped.items()}

    def by_labels(
        self, name: Name, keys: Sequence[str], **labels: str
    ) -> dict[tuple[str, ...], float]:
        """Those samples summed per values of ``keys`` (samples missing one,
        or with one empty, left out)."""
        _check_labels(name, dict.fromkeys(keys, ""))
        out: dict[tuple[str, ...], float] = {}
        for sample in self.samples(name, **labels):
            key = tuple(sample.labels.get(k, "") for k in keys)
            if all(key) and not math.isnan(sample.value):
                out[key] = out.get(key, 0.0) + sample.value
        return out

    def buckets(self, family: Family, **labels: str) -> dict[float, float]:
        """A histogram's cumulative bucket counts by upper bound, in order
        (``inf`` last), summed over the samples that match ``labels``."""
        _check_labels(family, labels)
        by_bound = self.by_label(family.bucket, BUCKET_BOUND, **labels)
        return dict(sorted((float(le), n) for le, n in by_bound.items()))

    def _values(self, name: Name, labels: Mapping[str, str]) -> list[float]:
        found = self.samples(name, **labels)
        return [s.value for s in found if not math.isnan(s.value)]

    def _sample_name(self, name: Name) -> str:
        if isinstance(name, Family):
            return name.sample
        if name not in self._by_name and self.kinds.get(name) == Kind.COUNTER:
            return name + "_total"
        return name


def _check_labels(name: Name, labels: Mapping[str, str]) -> None:
    """A family's lookup may only name its own labels (a misspelt label
    would otherwise match nothing, silently)."""
    if not isinstance(name, Family):
        return
    known = set(name.label_names)
    if name.kind is Kind.HISTOGRAM:
        known.add(BUCKET_BOUND)
    unknown = sorted(set(labels) - known)
    if unknown:
        raise ValueError(
            f"{name.name} has no label {', '.join(unknown)} "
            f"(its labels: {', '.join(name.label_names) or 'none'})"
        )


def _parse_error(text: str, error: Exception) -> str:
    """Why ``text`` does not parse: its first line that does not parse alone
    (else the parser's own word)."""
    for number, line in enumerate(text.splitlines(), 1):
        try:
            list(text_string_to_metric_families(line + "\n"))
        except (ValueError, IndexError):
            shown = line if len(line) <= 80 else line[:77] + "..."
            return f"not a Prometheus text exposition: line {number}: {shown!r}"
    return f"not a Prometheus text exposition: {error or type(error).__name__}"
