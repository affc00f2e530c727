"""vLLM's NIXL pull and push connectors with two CPU-host defects fixed.

Loaded by vLLM by the name kvpush's vLLM plugin registers
(:mod:`kvpush.vllm_plugin`)::

    --kv-transfer-config '{"kv_connector": "FairNixlConnector", ...}'

``FairNixlConnector`` is vLLM's ``NixlConnector`` (pull, READ) and
``FairNixlPushConnector`` is ``NixlPushConnector`` (push, WRITE). Both behave
exactly as upstream except for these two things, which on a small CPU
machine make the baselines erratic or hang (see ``docs/architecture.md``):

1. NIXL's agent starts a progress thread that busy-polls a whole core even
   when idle (NIXL's Python API hard-codes its poll delay to 0). The worker's
   agent gets a progress thread that sleeps ``PROGRESS_DELAY_US`` between
   polls instead. Turning the thread off altogether (``enable_prog_thread=
   False``) also stops the spin and serves sequential requests, but vLLM's
   push then wedges for good under 16 concurrent requests (its PUSH_REG
   notifications stop being progressed): measured here, see BENCHMARKS.md.
2. vLLM's NIXL worker calls ``os.sched_setaffinity(0, ...)`` while it is
   constructed, moving the worker's forward thread onto the last core of the
   NUMA node, which on a two-core machine is the other instance's core. The
   affinity the thread had before is restored right after construction.

Nothing else is changed: same scheduler, same worker, same wire protocol.
The launcher loads these on CPU hosts only; on CUDA it names vLLM's own
``NixlConnector`` and ``NixlPushConnector`` (:mod:`kvpush.launcher.platform`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector,
    NixlPushConnector,
)

# How long NIXL's progress thread sleeps between polls (microseconds).
# 500 us: idle workers use ~3% of a core instead of 100%, and vLLM push
# handles 16 concurrent requests (with the thread off it wedges under load).
PROGRESS_DELAY_US = 500


def _with_progress_delay(
    make_agent: Callable[..., Any], delay_us: int
) -> Callable[..., Any]:
    """Wrap NIXL's native agent constructor so that the agent's progress
    thread sleeps ``delay_us`` between polls instead of spinning."""

    def make(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return make_agent(name, config)

    return make


@contextlib.contextmanager
def fair_worker_construction() -> Iterator[None]:
    """Around the construction of vLLM's NIXL worker: make the agent's
    progress thread poll every ``PROGRESS_DELAY_US`` instead of spinning,
    and put the thread's CPU affinity back afterwards."""
    affinity = os.sched_getaffinity(0)
    bindings = sys.modules[base_worker.NixlWrapper.__module__].nixlBind
    original = bindings.nixlAgent
    bindings.nixlAgent = _with_progress_delay(original, PROGRESS_DELAY_US)
    try:
        yield
    finally:
        bindings.nixlAgent = original
        os.sched_setaffinity(0, affinity)


class _FairConstruction:
    """Mixin: build the worker-side connector inside
    :func:`fair_worker_construction`; the scheduler side is untouched."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        if role != KVConnectorRole.WORKER:
            super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
            return
        with fair_worker_construction():
            super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]


class FairNixlConnector(_FairConstruction, NixlConnector):
    """vLLM's pull-mode ``NixlConnector`` with the two CPU fixes."""


class FairNixlPushConnector(_FairConstruction, NixlPushConnector):
    """vLLM's ``NixlPushConnector`` with the two CPU fixes."""
