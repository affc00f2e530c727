"""Open this worker's NIXL agent over the KV cache vLLM allocated (both
roles, in ``register_kv_caches``): map the cache tensors to a
:class:`~kvpush.transfer.layout.KvLayout` (refusing any layout kvpush does
not map, see :mod:`kvpush.connector.kv_memory`) and register it."""

from __future__ import annotations

import torch

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.kv_memory import layout_of
from kvpush.connector.nixl_io import NixlIO, memory_type


def open_agent(config: ConnectorConfig, kv_caches: dict[str, torch.Tensor]) -> NixlIO:
    """The agent, named after the engine, with every layer registered."""
    first = next(iter(kv_caches.values()))
    num_blocks = config.num_blocks or int(first.shape[0])
    layout = layout_of(
        kv_caches,
        config.block_size,
        num_blocks,
        cache_dtype=config.cache_dtype,
        groups=config.kv_groups,
        tp_size=config.tp_size,
    )
    return NixlIO(
        config.agent_name,
        layout,
        memory_type(first.device.type),
        backend=config.nixl_backend,
    )
