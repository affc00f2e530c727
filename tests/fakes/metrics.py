"""Tests' shorthand for reading a ``/metrics`` text: one lookup, with the
product's reader (:mod:`kvpush.telemetry.reader`; no test depends on label
order or number formatting)."""

from __future__ import annotations

from kvpush.telemetry.reader import Exposition, Name


def metric(text: str, name: Name, **labels: str) -> float | None:
    """The sum of the samples ``name`` (a family, or a sample name) whose
    labels include ``labels`` (None when there is none)."""
    return Exposition.parse(text).total(name, **labels)


def families(text: str) -> dict[str, str]:
    """Family name -> type, of every family in ``text``."""
    return Exposition.parse(text).kinds
