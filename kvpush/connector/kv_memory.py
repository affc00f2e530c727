"""Map the KV-cache tensors vLLM allocated to a :class:`KvLayout`, or refuse.

Called once per worker, in ``register_kv_caches`` (Worker process), with the
dict vLLM passes there and the manager's ``num_blocks`` from the
``kv_cache_config`` the connector was built with. It only reads shapes,
strides and addresses; the tensors stay vLLM's.

What vLLM 0.32 allocates: one int8 buffer, viewed per layer as a 4-D
``[blocks, heads, tokens, K|V]`` tensor (``C`` = ``head_size + head_size_v``
elements of the cache dtype) whose strides follow the resolved layout. This is
the same for every attention backend (CPU_ATTN, FLASH_ATTN, FLASHINFER,
TRITON_ATTN); the backends differ only in which layouts they accept:

========  =====================================  ===========================
layout    memory of one layer                    kvpush
========  =====================================  ===========================
LBHNC     ``[B][H][N][C]`` (CPU's only one)      mapped: one region per layer
LBNHC     ``[B][N][H][C]`` (FlashAttention's     refused: same bytes per block
          default, "NHD")                        but another order inside it
LHBNC     ``[H][B][N][C]``                       refused: a block is H chunks
BLHNC,    ``[B][L][...]`` (layers interleaved    refused: blocks of a layer
BLNHC,    per block)                             are not adjacent
BHLNC
========  =====================================  ===========================

Only one interior order is mapped because :class:`KvLayout` does not record
it: two instances with different orders would pass the compatibility check
and exchange scrambled KV. The connector asks vLLM for LBHNC
(``get_required_kvcache_layout``), which CPU, FlashInfer and FlashAttention
accept.

Older 5-D shapes are mapped too when each block is row-major inside:
``[2, blocks, ...]`` (K and V separate, FlashAttention before 0.32: two
regions per layer, at ``t[0]`` and ``t[1]``) and ``[blocks, 2, ...]``
(FlashInfer before 0.32: one region).

A kernel block size below the logical one (vLLM splits each block into
``ratio`` kernel blocks: ``ratio * num_blocks`` blocks of ``block_size /
ratio`` tokens) is refused: the bytes of a logical block stay contiguous, but
their order depends on the kernel block size, which the peer cannot check.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

from kvpush.connector.config import ONE_FULL_GROUP, KvGroup
from kvpush.transfer.layout import KvLayout

_BYTE_CONTAINERS = (torch.uint8, torch.int8)
_MAX_DTYPE_NAME = 32


def layout_of(
    kv_caches: dict[str, torch.Tensor],
    block_size: int,
    num_blocks: int,
    *,
    cache_dtype: str = "auto",
    groups: Sequence[KvGroup] = ONE_FULL_GROUP,
    tp_size: int = 1,
) -> KvLayout:
    """The memory map of ``kv_caches`` (layer name -> cache tensor), whose
    blocks hold ``block_size`` tokens and number ``num_blocks``
    (``kv_cache_config.num_blocks``). ``cache_dtype`` is vLLM's
    ``--kv-cache-dtype``; it names the format when the tensors are plain
    bytes (fp8 is stored as uint8). Raises ``ValueError`` naming the layer,
    shape and strides for anything that is not equally strided contiguous
    blocks, identical in every layer. ``groups`` are vLLM's KV-cache
    groups: with more than one, each group's layer ``k`` must be layer
    slot ``k`` (the groups alias one allocation), else ``ValueError``
    naming the layer. A state group's described page
    (``KvGroup.page``) must hold, at TP ``tp_size``, the bytes its views
    hold, else ``ValueError``."""
    if not kv_caches:
        raise ValueError("vLLM registered no KV-cache tensors; nothing to map")
    has_state = any(g.is_state for g in groups)
    all_caches, kv_caches = kv_caches, without_states(kv_caches, groups)
    if not kv_caches:
        raise ValueError("vLLM registered no attention KV cache; nothing to map")
    if block_size < 1 or num_blocks < 1:
        raise ValueError(f"block_size {block_size} and num_blocks {num_blocks}")
    layers = _distinct(kv_caches)
    first_name, first = layers[0]
    first_regions = _regions(first_name, first, block_size, num_blocks)
    block_bytes = _block_bytes(first_name, first, first_regions[0])
    base_addrs: list[int] = []
    for name, tensor in layers:
        _check_like(name, tensor, first_name, first)
        regions = _regions(name, tensor, block_size, num_blocks)
        base_addrs.extend(region.data_ptr() for region in regions)
    _check_disjoint(base_addrs, num_blocks * block_bytes)
    if len(groups) > 1:
        _check_groups_alias(kv_caches, [g for g in groups if not g.is_state])
    if has_state and len(first_regions) != 1:
        raise ValueError(
            "state layers beside K and V kept apart: kvpush maps state pages "
            "in caches of one region per layer"
        )
    copy_bytes = [0] * len(groups)  # a whole block, but for state pages
    for g, group in enumerate(groups):
        for k, name in enumerate(group.layers if group.is_state else ()):
            content = _check_state_view(
                name, all_caches.get(name), base_addrs, k, block_bytes
            )
            copy_bytes[g] = max(copy_bytes[g], content)
            if group.page is not None and group.page.content_bytes(tp_size) != content:
                raise ValueError(
                    f"state layer {name} holds {content} bytes, its described "
                    f"page {group.page.content_bytes(tp_size)} at TP {tp_size}"
                )
    return KvLayout(
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        block_size=block_size,
        base_addrs=tuple(base_addrs),
        regions_per_layer=len(first_regions),
        device_id=first.device.index or 0,
        kv_dtype=_dtype_name(first.dtype, cache_dtype),
        kv_groups=tuple(g.kind for g in groups),
        group_copy_bytes=tuple(copy_bytes) if has_state else (),
        group_states=tuple(g.page for g in groups) if has_state else (),
    )


def _check_state_view(
    name: str,
    view: torch.Tensor | None,
    base_addrs: list[int],
    slot: int,
    block_bytes: int,
) -> int:
    """A state layer's cache (vLLM's one byte view of a Mamba layer's
    pages, ``[blocks, 1, 1, state bytes]``) is layer slot ``slot``'s memory,
    block for block: a copy of the first bytes of the slot's block copies
    its state. Returns how many (the state's bytes, the rest padding)."""
    if view is None or slot >= len(base_addrs):
        raise ValueError(f"state layer {name}: no cache, or no layer slot {slot}")
    page = view.stride(0) * view.element_size()
    content = view[0].numel() * view.element_size()
    if view.data_ptr() != base_addrs[slot] or page != block_bytes or content > page:
        raise ValueError(
            f"state layer {name} ({tuple(view.shape)}, strides {view.stride()}) "
            f"is not slot {slot}'s blocks of {block_bytes} bytes: kvpush maps "
            "state pages that share the attention layers' allocation"
        )
    return content


def _check_groups_alias(
    kv_caches: dict[str, torch.Tensor], groups: Sequence[KvGroup]
) -> None:
    """Every group's layer ``k`` is slot ``k``: a block id then names the
    same bytes whichever group holds it, and a copy of block ``b`` over
    every slot writes only what the group holding ``b`` owns."""
    slots = layer_indices(kv_caches)
    for g, group in enumerate(groups):
        for k, name in enumerate(group.layers):
            if slots.get(name) != k:
                raise ValueError(
                    f"KV-cache group {g}'s layer {k} ({name}) is not layer slot "
                    f"{k} but {slots.get(name)}: kvpush maps groups that share "
                    "one allocation, layer k of every group in slot k"
                )


def without_states(
    kv_caches: dict[str, torch.Tensor], groups: Sequence[KvGroup]
) -> dict[str, torch.Tensor]:
    """``kv_caches`` less the state layers' views (Mamba: their pages are
    the attention slots' own bytes, mapped once, by :func:`layout_of`)."""
    states = {n for g in groups if g.is_state for n in g.layers}
    return {n: t for n, t in kv_caches.items() if n not in states}


def region_views(
    kv_caches: dict[str, torch.Tensor], block_size: int, num_blocks: int
) -> list[torch.Tensor]:
    """Each region of :func:`layout_of`'s map (in ``base_addrs`` order) as
    its ``num_blocks`` blocks, block index first; views, never copies."""
    return [
        region[:num_blocks]
        for name, tensor in _distinct(kv_caches)
        for region in _regions(name, tensor, block_size, num_blocks)
    ]


def layer_indices(kv_caches: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each layer name's layer in :func:`layout_of`'s map (vLLM's order; a
    name that aliases an earlier layer's cache maps to that layer): what
    ``save_kv_layer``'s layer name is turned into."""
    first_of: dict[tuple[object, ...], int] = {}
    indices = {}
    for name, tensor in kv_caches.items():
        key = _key(tensor)
        indices[name] = first_of.setdefault(key, len(first_of))
    return indices


def _key(tensor: torch.Tensor) -> tuple[object, ...]:
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def _distinct(kv_caches: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The layers in vLLM's order, less those that alias an earlier layer's
    whole cache (vLLM's cross-layer KV sharing hands one tensor to several
    layer names; copying it once is enough)."""
    seen: set[tuple[object, ...]] = set()
    layers = []
    for name, tensor in kv_caches.items():
        key = _key(tensor)
        if key not in seen:
            seen.add(key)
            layers.append((name, tensor))
    return layers


def _regions(
    name: str, t: torch.Tensor, block_size: int, num_blocks: int
) -> list[torch.Tensor]:
    """The per-region views of one layer, each with the block index first."""
    shape = tuple(t.shape)
    is_block_first = t.dim() >= 2 and shape[0] == num_blocks
    is_kv_first = t.dim() >= 3 and shape[0] == 2 and shape[1] == num_blocks
    if is_block_first and is_kv_first:
        raise ValueError(
            f"layer {name}: cache shape {shape} with num_blocks={num_blocks} is "
            "ambiguous (is dim 0 the blocks or K/V?); kvpush refuses to guess"
        )
    if is_kv_first:
        return [t[0], t[1]]
    if not is_block_first:
        raise ValueError(_no_block_dim(name, t, block_size, num_blocks))
    if t.dim() == 4 and shape[2] != block_size:  # vLLM's [B, H, N, C]
        divides = shape[2] and block_size % shape[2] == 0
        hint = _kernel_hint(block_size, shape[2]) if divides else ""
        raise ValueError(
            f"layer {name}: cache shape {shape} holds {shape[2]} tokens per block, "
            f"not --block-size {block_size}{hint}"
        )
    return [t]


def _no_block_dim(name: str, t: torch.Tensor, block_size: int, num_blocks: int) -> str:
    shape = tuple(t.shape)
    counts = [shape[0]] + ([shape[1]] if t.dim() >= 3 and shape[0] == 2 else [])
    for count in counts:
        if count > num_blocks and count % num_blocks == 0:
            ratio = count // num_blocks
            return (
                f"layer {name}: cache shape {shape} has {count} blocks, {ratio} "
                f"times vLLM's {num_blocks}: the attention backend splits each "
                f"{block_size}-token block into kernel blocks of "
                f"{block_size // ratio} tokens"
                f"{_kernel_hint(block_size, block_size // ratio)}"
            )
    return (
        f"layer {name}: cache shape {shape} (strides {t.stride()}) has no "
        f"dimension of num_blocks={num_blocks} where kvpush expects the blocks "
        "(dim 0, or dim 1 after a K/V dim of 2)"
    )


def _kernel_hint(block_size: int, kernel_block_size: int) -> str:
    return (
        f". kvpush needs the kernel block size ({kernel_block_size}) to equal the "
        f"logical block size ({block_size}): run with --block-size "
        f"{kernel_block_size}, a size the attention backend supports natively"
    )


def _block_bytes(name: str, t: torch.Tensor, region: torch.Tensor) -> int:
    """Bytes of one block of ``region`` (of layer tensor ``t``), from its
    strides; raises unless each block is one row-major chunk and the next
    block starts right after it."""
    block = region[0]
    stride = region.stride(0) if region.shape[0] > 1 else block.numel()
    if not block.is_contiguous() or stride != block.numel() or stride == 0:
        raise ValueError(
            f"layer {name}: cache shape {tuple(t.shape)} with strides {t.stride()} "
            "does not store each block as one contiguous row-major chunk right "
            "after the previous one (kvpush maps the LBHNC layout, "
            "VLLM_KV_CACHE_LAYOUT=LBHNC, only)"
        )
    return stride * t.element_size()


def _check_like(
    name: str, t: torch.Tensor, first_name: str, first: torch.Tensor
) -> None:
    mine = (tuple(t.shape), t.stride(), t.dtype, t.device)
    theirs = (tuple(first.shape), first.stride(), first.dtype, first.device)
    if mine != theirs:
        raise ValueError(
            "kvpush needs every layer's cache laid out alike: layer "
            f"{name} has (shape, strides, dtype, device) {mine}, layer "
            f"{first_name} {theirs}"
        )


def _check_disjoint(base_addrs: list[int], span: int) -> None:
    ordered = sorted(base_addrs)
    for low, high in pairwise(ordered):
        if high < low + span:
            raise ValueError(
                f"KV regions at {low:#x} and {high:#x} overlap ({span} bytes "
                "each); kvpush needs each layer's cache in its own memory"
            )


def _dtype_name(dtype: torch.dtype, cache_dtype: str) -> str:
    """The element type for the peers' compatibility check; a byte container
    also names the format stored in it (fp8_e4m3 and fp8_e5m2 are both uint8)."""
    name = str(dtype).removeprefix("torch.")
    if dtype in _BYTE_CONTAINERS and cache_dtype != "auto":
        name = f"{cache_dtype}/{name}"
    if len(name) > _MAX_DTYPE_NAME:
        raise ValueError(f"KV dtype name {name!r} is too long")
    return name
