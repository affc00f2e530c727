"""Where one instance's KV cache lives in memory, and whether two can talk.

A :class:`KvLayout` is built once by the worker-side connector in
``register_kv_caches`` (from the tensors vLLM hands it), sent to the peer in a
:class:`~kvpush.transfer.messages.Hello`, and read by
:func:`kvpush.transfer.coalesce.descriptors` to turn block ids into memory
descriptors. It is immutable and owns no memory: the KV tensors stay owned by
vLLM, and the layout is only a map of them.

Model: the cache is a list of *regions*, each an array of ``num_blocks``
equally sized blocks of ``block_bytes`` bytes starting at ``base_addrs[r]``.
A layer has ``regions_per_layer`` consecutive regions: 1 on vLLM's CPU backend
(one tensor ``[num_blocks, kv_heads, block_size, 2*head_size]`` per layer, K
and V of a block side by side), 2 where K and V are separate tensors. Block
``b`` of region ``r`` is the contiguous chunk
``[base_addrs[r] + b*block_bytes, +block_bytes)``, so consecutive block ids
are consecutive memory within a region.

KV-cache groups (vLLM's hybrid manager: sliding-window layers beside full
ones) share the regions: layer ``k`` of every group is layer slot ``k``,
one block pool for all, so block ``b`` of a slot belongs to whichever group
holds ``b`` for its request. ``kv_groups`` names each group's kind; two
instances copy block for block only when they group alike. A group whose
blocks hold less than a block's bytes (a Mamba state, padded to the
attention page) copies only its first ``group_copy_bytes[g]`` bytes of
each region's block (0, or no entries: the whole block); where
``group_states[g]`` describes that page
(:class:`~kvpush.transfer.state_pages.StatePage`, the same at every TP
size), two instances of different TP sizes copy its pieces
(:meth:`~kvpush.transfer.state_pages.StatePage.pieces`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvpush.transfer.state_pages import StatePage

# The one interior order kvpush maps (kvpush.connector.kv_memory): each
# block of a region is [heads][tokens][K|V], vLLM's "HND".
REQUIRED_KV_CACHE_LAYOUT = "LBHNC"
_ADDR_LIMIT = 2**64
MAX_REGIONS = 4096

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


class KvLayout(msgspec.Struct, frozen=True):
    """The memory map of one instance's paged KV cache (one worker).

    ``block_size`` is in tokens, ``block_bytes`` in bytes of one block of one
    region; ``kv_dtype`` names the element type (e.g. ``"float32"``) and
    exists only for the compatibility check. Invalid values raise
    ``ValueError`` at construction (and fail decoding when received).
    """

    num_blocks: PosInt
    block_bytes: PosInt
    block_size: PosInt
    base_addrs: Annotated[tuple[NonNegInt, ...], msgspec.Meta(max_length=MAX_REGIONS)]
    regions_per_layer: PosInt = 1
    device_id: NonNegInt = 0
    kv_dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""
    # each KV-cache group's kind (kvpush.connector.config.kv_group_kind)
    kv_groups: Annotated[
        tuple[Annotated[str, msgspec.Meta(max_length=64)], ...],
        msgspec.Meta(max_length=64),
    ] = ("full",)
    # bytes a copy of each group's block takes from the start of each
    # region's block (0: all of it; empty: every group all of it)
    group_copy_bytes: Annotated[tuple[NonNegInt, ...], msgspec.Meta(max_length=64)] = ()
    # each group's state page, where it has one kvpush describes (empty: none)
    group_states: Annotated[
        tuple[StatePage | None, ...], msgspec.Meta(max_length=64)
    ] = ()

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_bytes < 1 or self.block_size < 1:
            raise ValueError(
                "num_blocks, block_bytes and block_size must all be >= 1, got "
                f"{self.num_blocks}, {self.block_bytes}, {self.block_size}"
            )
        if self.regions_per_layer < 1 or self.device_id < 0:
            raise ValueError("regions_per_layer must be >= 1 and device_id >= 0")
        if not self.base_addrs or len(self.base_addrs) % self.regions_per_layer:
            raise ValueError(
                f"base_addrs must hold a positive multiple of regions_per_layer="
                f"{self.regions_per_layer} addresses, got {len(self.base_addrs)}"
            )
        copies = self.group_copy_bytes
        if copies and (
            len(copies) != len(self.kv_groups)
            or any(not 0 <= c <= self.block_bytes for c in copies)
        ):
            raise ValueError(
                f"group_copy_bytes {copies} must name each of the "
                f"{len(self.kv_groups)} groups at most block_bytes={self.block_bytes}"
            )
        if self.group_states and len(self.group_states) != len(self.kv_groups):
            raise ValueError(
                f"group_states names {len(self.group_states)} groups, not "
                f"{len(self.kv_groups)}"
            )
        span = self.num_blocks * self.block_bytes
        for addr in self.base_addrs:
            if addr < 0 or addr + span > _ADDR_LIMIT:
                raise ValueError(f"region at {addr:#x} of {span} bytes is out of range")

    @classmethod
    def contiguous_layers(
        cls,
        base_addr: int,
        num_layers: int,
        num_blocks: int,
        block_bytes: int,
        block_size: int,
        kv_dtype: str = "",
    ) -> KvLayout:
        """The CPU backend's layout: every layer a view into one allocation,
        layer ``L`` starting ``L * num_blocks * block_bytes`` after layer 0."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        stride = num_blocks * block_bytes
        addrs = tuple(base_addr + layer * stride for layer in range(num_layers))
        return cls(
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            block_size=block_size,
            base_addrs=addrs,
            kv_dtype=kv_dtype,
        )

    @property
    def num_layers(self) -> int:
        return len(self.base_addrs) // self.regions_per_layer

    def regions(self, layer: int) -> range:
        """Indices into ``base_addrs`` of the regions that make up ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.num_layers - 1}")
        start = layer * self.regions_per_layer
        return range(start, start + self.regions_per_layer)

    def copy_bytes(self, group: int) -> int | None:
        """The bytes a copy of a block of KV-cache group ``group`` takes
        from the start of each region's block; None for the whole block."""
        copies = self.group_copy_bytes
        return (copies[group] or None) if copies else None

    def state_page(self, group: int) -> StatePage | None:
        """Group ``group``'s state page, where kvpush describes it."""
        return self.group_states[group] if self.group_states else None

    def block_addr(self, region: int, block_id: int) -> int:
        """Address of block ``block_id`` in region ``region``."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside 0..{self.num_blocks - 1}")
        return self.base_addrs[region] + block_id * self.block_bytes


def compat_problem(local: KvLayout, remote: KvLayout) -> str | None:
    """Why blocks cannot be copied one-to-one between ``local`` and ``remote``,
    or ``None`` when they can. ``num_blocks`` and addresses may differ; the
    shape of one block and the number of layers and regions may not.
    Called by the prefill side when a decode's :class:`Hello` arrives."""
    for field in ("block_bytes", "block_size", "regions_per_layer", "kv_dtype"):
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            return f"{field} differs: local {mine!r}, remote {theirs!r}"
    if local.num_layers != remote.num_layers:
        return (
            f"num_layers differs: local {local.num_layers}, remote {remote.num_layers}"
        )
    return groups_problem(local, remote)


def groups_problem(local: KvLayout, remote: KvLayout) -> str | None:
    """Why the two instances' KV-cache groups differ in meaning, or None:
    the same kinds in the same order, and each state group either the same
    described page (its bytes per rank follow from the TP size) or, not
    described, the same kind and copied bytes."""
    if len(local.kv_groups) != len(remote.kv_groups):
        return (
            f"kv_groups differs: local {local.kv_groups!r}, remote {remote.kv_groups!r}"
        )
    for g, (mine, theirs) in enumerate(
        zip(local.kv_groups, remote.kv_groups, strict=True)
    ):
        page = local.state_page(g)
        if page is not None or remote.state_page(g) is not None:
            if page != remote.state_page(g):
                return (
                    f"group {g}'s state page differs: local {page!r}, remote "
                    f"{remote.state_page(g)!r}"
                )
        elif mine != theirs or local.copy_bytes(g) != remote.copy_bytes(g):
            return (
                f"group {g} differs: local {mine!r} copying "
                f"{local.copy_bytes(g)} bytes, remote {theirs!r} copying "
                f"{remote.copy_bytes(g)}"
            )
    return None
