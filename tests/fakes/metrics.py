"""Reading a Prometheus text exposition in tests, with ``prometheus_client``'s
own parser (no test depends on label order or number formatting)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples called ``name`` whose labels include
    ``labels`` (None when there is none)."""
    found = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    return sum(found) if found else None


def families(text: str) -> dict[str, str]:
    """Family name -> type, of every family in ``text``."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}
