"""KV digests: prefill and decode hash the same bytes of one transfer, so
decode can prove the KV it received is the KV prefill sent (silent
corruption on the path: a NIC, a driver, a WRITE landing in the wrong
place) before vLLM serves a request from it.

What is hashed, by construction the same on both sides: the bytes one
prefill rank writes to one decode rank in one transfer (every WRITE of
it, whatever the push granularity: whole, per chunk, per layer), ordered
by their **destination address** in decode's memory. Prefill hashes its
source ranges of those copies (:func:`source_ranges`, over every prompt
block it writes from decode's ``first_block`` on, every layer, its
:class:`~kvpush.transfer.shares.HeadSlice` of each block), in the order of
the destination ranges they land in; decode hashes its destination ranges
(:func:`destination_ranges`: its registered blocks, its layout, the head
slice it receives from that prefill rank), in address order. Destination
ranges of one pair never overlap (every byte has one writer), so the two
byte streams are equal exactly when the KV landed intact. Coalescing
does not matter: a run is the same bytes as its blocks one after another.

The digest is SHA-256 (:data:`DIGEST_BYTES`): measured the fastest
stdlib hash on the dev machine, which has SHA extensions (0.66 GiB/s,
against 0.36 GiB/s for BLAKE2b; ``docs/design.md``, "KV digests").
Not a MAC: it detects corruption, not a forger (the side channel's HMAC
is what authenticates peers).

Which transfers: :class:`VerifyPolicy` (``off``, ``sample``, ``all``).
``sample`` picks a transfer from its id alone (:func:`sample_point`), so
both sides pick the same transfers without a message. Pure: no memory is
read here except through the ``read`` callable the caller passes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpush.transfer import groups
from kvpush.transfer.groups import GroupBlocks
from kvpush.transfer.heads import group_descriptors, state_pieces
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.shares import HeadSlice

VERIFY_MODES: tuple[str, ...] = ("off", "sample", "all")
DEFAULT_VERIFY_KV = "off"
DEFAULT_VERIFY_SAMPLE = 0.01  # the fraction ``sample`` verifies by default
DIGEST_BYTES = 32  # SHA-256

Ranges = npt.NDArray[np.uint64]
"""``(N, 2)`` uint64: one ``(addr, length)`` memory range per row."""
Read = Callable[[int, int], Any]
"""``read(addr, length)``: a buffer (bytes-like) over that memory range."""


def check_verify_kv(mode: str, fraction: float) -> None:
    """Raise ValueError unless ``mode`` and ``fraction`` are a valid policy."""
    if mode not in VERIFY_MODES:
        raise ValueError(
            f"verify_kv must be one of {', '.join(VERIFY_MODES)}, not {mode!r}"
        )
    if not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"verify_kv_sample must be a fraction in (0, 1], not {fraction!r}"
        )


def sample_point(transfer_id: str) -> float:
    """Where ``transfer_id`` falls in [0, 1): the first 8 bytes of its
    SHA-256. A transfer is sampled at fraction ``f`` when this is below
    ``f``; the router's ids are uuid4s, so this is uniform."""
    head = hashlib.sha256(transfer_id.encode()).digest()[:8]
    return int.from_bytes(head, "big") / 2.0**64


@dataclass(frozen=True)
class VerifyPolicy:
    """Which transfers are digested (prefill) and verified (decode)."""

    mode: str = DEFAULT_VERIFY_KV
    fraction: float = DEFAULT_VERIFY_SAMPLE  # used by ``sample`` only

    def __post_init__(self) -> None:
        check_verify_kv(self.mode, self.fraction)

    def selects(self, transfer_id: str) -> bool:
        if self.mode == "all":
            return True
        if self.mode == "off":
            return False
        return sample_point(transfer_id) < self.fraction


VERIFY_OFF = VerifyPolicy()


def source_ranges(
    src_block_ids: GroupBlocks,
    dst_block_ids: GroupBlocks,
    src: KvLayout,
    dst: KvLayout,
    head_slice: HeadSlice,
) -> Ranges:
    """Prefill's side: the source ranges of every copy of ``head_slice``
    from ``src_block_ids[g][i]`` to ``dst_block_ids[g][i]`` (per KV-cache
    group) in every layer, ordered by the destination address each lands
    at."""
    layers = range(src.num_layers)
    src_d, dst_d, _ = group_descriptors(
        src_block_ids, dst_block_ids, src, dst, layers, head_slice
    )
    order = np.argsort(dst_d[:, 0], kind="stable")
    return np.ascontiguousarray(src_d[order][:, :2])


def destination_ranges(
    dst_block_ids: GroupBlocks, dst: KvLayout, head_slice: HeadSlice
) -> Ranges:
    """Decode's side: where ``head_slice`` lands in every group's
    ``dst_block_ids`` of every layer, in address order (one range per block
    per region; null blocks are not written, :func:`groups.aligned`; a
    state group, :func:`~kvpush.transfer.heads.state_pieces` of a block)."""
    head_bytes = dst.block_bytes // head_slice.dst.num_heads
    offset = np.uint64(head_slice.dst_heads.start * head_bytes)
    bases = np.asarray(dst.base_addrs, dtype=np.uint64)
    parts = []
    for g, table in enumerate(dst_block_ids):
        ids = np.asarray(groups.real((table,)), dtype=np.uint64)
        starts = (bases[:, None] + ids[None, :] * np.uint64(dst.block_bytes)).ravel()
        if dst.copy_bytes(g) is None:
            part = np.empty((starts.size, 2), dtype=np.uint64)
            part[:, 0] = starts + offset
            part[:, 1] = head_slice.num_heads * head_bytes
        else:
            pieces = state_pieces(dst, g, head_slice).astype(np.uint64)
            part = np.empty((starts.size, len(pieces), 2), dtype=np.uint64)
            part[:, :, 0] = starts[:, None] + pieces[None, :, 1]
            part[:, :, 1] = pieces[None, :, 2]
            part = part.reshape(-1, 2)
        parts.append(part)
    out = np.concatenate(parts) if parts else np.empty((0, 2), dtype=np.uint64)
    return np.ascontiguousarray(out[np.argsort(out[:, 0], kind="stable")])


def digest(ranges: Ranges, read: Read) -> bytes:
    """SHA-256 of the bytes of ``ranges``, in their order. ``hashlib``
    releases the GIL while it hashes a large buffer."""
    h = hashlib.sha256()
    for addr, length in ranges.tolist():
        h.update(read(addr, length))
    return h.digest()
