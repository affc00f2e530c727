"""vLLM's NIXL pull and push connectors with two CPU-host defects fixed.

Loaded by vLLM through ``kv_connector_module_path``::

    --kv-transfer-config '{"kv_connector": "FairNixlConnector",
        "kv_connector_module_path": "kvpush.baselines.fair_nixl", ...}'

``FairNixlConnector`` is vLLM's ``NixlConnector`` (pull, READ) and
``FairNixlPushConnector`` is ``NixlPushConnector`` (push, WRITE). Both behave
exactly as upstream except for these two things, which on a small CPU
machine make the baselines erratic or hang (see ``docs/architecture.md``):

1. NIXL's agent starts a UCX progress thread by default that busy-polls a
   whole core even when idle. The worker's agent is created with
   ``enable_prog_thread=False``; transfers still complete because vLLM polls
   transfer state from its own loop.
2. vLLM's NIXL worker calls ``os.sched_setaffinity(0, ...)`` while it is
   constructed, moving the worker's forward thread onto the last core of the
   NUMA node, which on a two-core machine is the other instance's core. The
   affinity the thread had before is restored right after construction.

Nothing else is changed: same scheduler, same worker, same wire protocol.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector,
    NixlPushConnector,
)


def _without_progress_thread(make_config: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``nixl_agent_config`` so that every agent it configures has no
    busy-polling progress thread."""

    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return make_config(*args, **kwargs)

    return make


@contextlib.contextmanager
def fair_worker_construction() -> Iterator[None]:
    """Around the construction of vLLM's NIXL worker: force the agent's
    progress thread off and put the thread's CPU affinity back afterwards."""
    affinity = os.sched_getaffinity(0)
    original = base_worker.nixl_agent_config
    if original is not None:
        base_worker.nixl_agent_config = _without_progress_thread(original)
    try:
        yield
    finally:
        base_worker.nixl_agent_config = original
        os.sched_setaffinity(0, affinity)


class FairNixlConnector(NixlConnector):
    """vLLM's pull-mode ``NixlConnector`` with the two CPU fixes."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        if role != KVConnectorRole.WORKER:
            super().__init__(vllm_config, role, kv_cache_config)
            return
        with fair_worker_construction():
            super().__init__(vllm_config, role, kv_cache_config)


class FairNixlPushConnector(NixlPushConnector):
    """vLLM's ``NixlPushConnector`` with the two CPU fixes."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        if role != KVConnectorRole.WORKER:
            super().__init__(vllm_config, role, kv_cache_config)
            return
        with fair_worker_construction():
            super().__init__(vllm_config, role, kv_cache_config)
