"""Configuration names: what ``--configs`` may list, and the cluster each is.

- ``colocated``, ``vllm-pull``, ``vllm-push``, ``kvpush``: the launcher's
  modes, each with its defaults;
- ``kvpush-<binding>`` (``kvpush-auto``, ``kvpush-early``, ...): kvpush
  with its router's ``--binding`` forced or decided;
- ``kvpush-first-token-decode``: kvpush with its router's
  ``--first-token-from decode`` (the client's first token is decode's, as
  before the router streamed prefill's; the default is prefill's), and
  ``kvpush-<binding>-first-token-decode`` with that binding too;
- ``kvpush-t1-recomputed`` (and ``kvpush-<binding>-t1-recomputed``):
  kvpush with decode on vLLM's own scheduler class, so that a request
  bound early computes prefill's first token again (kvpush's class
  continues from it: :mod:`kvpush.connector.decode.first_token`); a
  decode setting, so it needs a cluster of its own;
- ``kvpush.<granularity>`` (``kvpush.request``, ``kvpush.chunk``,
  ``kvpush.layer``, ``kvpush.auto``): kvpush with prefill's connector at
  that ``--push-granularity``.

A hyphen sets the router, a dot the connector: ``auto`` names both a
binding and a granularity, and ``kvpush-auto`` / ``kvpush.auto`` keep them
apart. The granularity is prefill's connector config, so each
``kvpush.<granularity>`` needs a cluster of its own (it never shares one).
"""

from __future__ import annotations

from kvpush.connector.config import PUSH_GRANULARITIES
from kvpush.router.binding import POLICIES
from kvpush.topology import MODES

# kvpush with its router's binding forced (kvpush-early) or decided (kvpush-auto)
BINDING_CONFIGS = {f"kvpush-{policy}": policy for policy in POLICIES}
# kvpush with prefill pushing per request, chunk or layer (or choosing: auto)
GRANULARITY_CONFIGS = {f"kvpush.{g}": g for g in PUSH_GRANULARITIES}
# kvpush with its router's first token from decode (the default: prefill),
# with the router's default binding or a forced one (kvpush-late-first-token-decode)
FIRST_TOKEN_CONFIGS = {
    f"{base}-first-token-decode": "decode" for base in ("kvpush", *BINDING_CONFIGS)
}
# kvpush with decode computing prefill's first token again (vLLM's scheduler)
RECOMPUTE_CONFIGS = tuple(
    f"{base}-t1-recomputed" for base in ("kvpush", *BINDING_CONFIGS)
)
# configurations that need a cluster of their own (a connector or decode setting)
OWN_CLUSTER_CONFIGS = (*GRANULARITY_CONFIGS, *RECOMPUTE_CONFIGS)
CONFIG_NAMES = (
    *MODES,
    *BINDING_CONFIGS,
    *FIRST_TOKEN_CONFIGS,
    *RECOMPUTE_CONFIGS,
    *GRANULARITY_CONFIGS,
)


def cluster_of(name: str) -> tuple[str, str | None]:
    """A configuration's cluster mode and router binding (None: the
    router's default)."""
    if name in FIRST_TOKEN_CONFIGS:
        name = name.removesuffix("-first-token-decode")
    if name in RECOMPUTE_CONFIGS:
        name = name.removesuffix("-t1-recomputed")
    if name in BINDING_CONFIGS:
        return "kvpush", BINDING_CONFIGS[name]
    if name in GRANULARITY_CONFIGS:
        return "kvpush", None
    return name, None


def first_token_of(name: str) -> str | None:
    """Where a configuration's router takes the first token from (None:
    the router's default)."""
    return FIRST_TOKEN_CONFIGS.get(name)


def recomputes_first_token(name: str) -> bool:
    """Whether a configuration's decode runs vLLM's own scheduler class."""
    return name in RECOMPUTE_CONFIGS


def granularity_of(name: str) -> str | None:
    """The push granularity a configuration sets (None: the launcher's)."""
    return GRANULARITY_CONFIGS.get(name)


def unknown_names_message(unknown: list[str]) -> str:
    """What to say about configuration names that are none of the above."""
    hints = []
    for name in unknown:
        head, sep, tail = name.partition("-")
        if sep and head == "kvpush" and f"kvpush.{tail}" in GRANULARITY_CONFIGS:
            hints.append(f"{name!r} is not a binding: for push granularity "
                         f"{tail!r} write kvpush.{tail}")  # fmt: skip
        head, sep, tail = name.partition(".")
        if sep and head == "kvpush" and tail not in PUSH_GRANULARITIES:
            hints.append(f"{name!r}: push granularities are "
                         f"{', '.join(PUSH_GRANULARITIES)}")  # fmt: skip
    text = (
        f"unknown configs {unknown}; choose from {', '.join(CONFIG_NAMES)} "
        "(kvpush-<binding> sets the router's binding, kvpush.<granularity> "
        "prefill's --push-granularity)"
    )
    return text + "".join(f"; {h}" for h in hints)
