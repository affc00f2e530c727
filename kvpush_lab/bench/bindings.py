"""The binding mix: how kvpush's router bound the requests it was sent.

Two views, pure functions of text and records:

- the router's own counter ``kvpush_router_binding_total{binding,reason}``
  on its ``/metrics``, read before and after a run (:func:`parse_counts`,
  :func:`count_delta`): every *attempt*, retries included, with its reason;
- the response headers of every request (``x-kvpush-binding``,
  ``x-kvpush-decode``, kept in each record): what the client's answer
  came through (:func:`header_mix`).

Routers of other modes (the baselines) send no such headers and count
nothing: their mix is empty.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import msgspec

from kvpush.telemetry import names
from kvpush.telemetry.reader import Exposition

BINDING_HEADER = "x-kvpush-binding"  # as the router sends them
DECODE_HEADER = "x-kvpush-decode"

Counts = dict[str, int]  # "binding/reason" -> attempts


class BindingMix(msgspec.Struct, frozen=True, kw_only=True):
    """Requests per binding and per decode, by their response headers
    (requests that got no answer, or no header, count as ``none``)."""

    bindings: dict[str, int] = msgspec.field(default_factory=dict)
    decodes: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return set(self.bindings) <= {"none"}


def parse_counts(metrics_text: str) -> Counts:
    """The binding counter's samples summed per binding and reason (over
    any other label, e.g. the router's mode); keys ``binding/reason``
    (``ValueError`` when the text does not parse)."""
    counts = Exposition.parse(metrics_text).by_labels(
        names.ROUTER_BINDING, ("binding", "reason")
    )
    return {f"{binding}/{reason}": round(n) for (binding, reason), n in counts.items()}


def count_delta(before: Counts, after: Counts) -> Counts:
    """What the counter gained between two readings (keys that did not
    move left out)."""
    delta = {key: after[key] - before.get(key, 0) for key in after}
    return {key: n for key, n in sorted(delta.items()) if n}


def header_mix(headers: Iterable[tuple[str | None, str | None]]) -> BindingMix:
    """The mix of (binding, decode) header pairs, one per request."""
    bindings: Counter[str] = Counter()
    decodes: Counter[str] = Counter()
    for binding, decode in headers:
        bindings[binding or "none"] += 1
        if decode:
            decodes[decode] += 1
    return BindingMix(
        bindings=dict(sorted(bindings.items())), decodes=dict(sorted(decodes.items()))
    )


def describe_counts(counts: Counts) -> str:
    """``early 12 (new_tokens 12), skip 8 (few_new_tokens 6, prefix_held 2)``."""
    if not counts:
        return "–"
    by_binding: dict[str, dict[str, int]] = {}
    for key, n in counts.items():
        binding, _, reason = key.partition("/")
        by_binding.setdefault(binding, {})[reason] = n
    parts = []
    for binding, reasons in sorted(by_binding.items()):
        inner = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items()))
        parts.append(f"{binding} {sum(reasons.values())} ({inner})")
    return ", ".join(parts)


def describe_share(counts: dict[str, int]) -> str:
    """``early 12, skip 8`` (``–`` when empty)."""
    return ", ".join(f"{k} {n}" for k, n in counts.items()) or "–"
