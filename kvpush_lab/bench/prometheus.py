"""Samples of a Prometheus text exposition (what ``/metrics`` serves): pure.

Parsed by ``prometheus_client``'s own parser; only what the bench and the
soak need is kept: each sample's name, labels and value. A text that stops
parsing yields the samples before the bad line.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    """One sample of the exposition: metric name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition."""
    samples: list[Sample] = []
    try:
        for family in text_string_to_metric_families(text):
            samples += [Sample(s.name, dict(s.labels), s.value) for s in family.samples]
    except ValueError:
        pass  # the samples so far
    return samples
