"""Read (and, for fault injection only, flip) bytes of this worker's KV
cache by address: what KV digests hash (:mod:`kvpush.transfer.digest`).

Built once per worker in ``register_kv_caches`` from the tensors vLLM
registers and the :class:`~kvpush.transfer.layout.KvLayout` mapped from
them; it keeps byte views of each region (never a copy of the cache).
A read of host memory is a zero-copy view; of device memory, a copy to
the host of just that range (the digest is computed on the host).
"""

from __future__ import annotations

import bisect
from typing import Any, Protocol

import torch

from kvpush.connector.kv_memory import region_views
from kvpush.transfer.layout import KvLayout


class KvBytes(Protocol):
    """What the digests need of a worker's KV memory."""

    def read(self, addr: int, length: int) -> Any:
        """A bytes-like buffer over ``[addr, addr + length)``."""
        ...

    def flip(self, addr: int) -> None:
        """Invert the byte at ``addr`` (fault injection only)."""
        ...


class TensorBytes:
    """:class:`KvBytes` over vLLM's KV-cache tensors."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layout: KvLayout) -> None:
        views = region_views(kv_caches, layout.block_size, layout.num_blocks)
        span = layout.num_blocks * layout.block_bytes
        flat: dict[int, torch.Tensor] = {}
        for view in views:
            data = view.reshape(-1).view(torch.uint8)
            if data.data_ptr() != view.data_ptr() or data.numel() != span:
                raise ValueError("a KV region is not one contiguous byte range")
            flat[view.data_ptr()] = data
        if sorted(flat) != sorted(layout.base_addrs):
            raise ValueError("the KV tensors do not match their layout")
        self._starts = sorted(flat)
        self._regions = [flat[a] for a in self._starts]
        self._span = span

    def _at(self, addr: int, length: int) -> torch.Tensor:
        i = bisect.bisect_right(self._starts, addr) - 1
        offset = addr - self._starts[i] if i >= 0 else -1
        if offset < 0 or length < 0 or offset + length > self._span:
            raise ValueError(f"{length} bytes at {addr:#x} are outside the KV cache")
        return self._regions[i][offset : offset + length]

    def read(self, addr: int, length: int) -> Any:
        data = self._at(addr, length)
        if data.device.type != "cpu":
            data = data.cpu()
        return data.numpy()

    def flip(self, addr: int) -> None:
        self._at(addr, 1).bitwise_not_()
