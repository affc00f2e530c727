"""A per-request state page (Mamba2, gated delta net) across TP sizes: which
bytes of a prefill rank's page a decode rank's page takes.

A state page holds, per TP rank and packed from byte 0 (vLLM's
``MambaBase.bind_kv_cache``), the layer's **conv state** then its
**recurrent state**; the rest of the page is padding.

* The conv state is ``rows x dim`` (:attr:`ConvLayout.SD`, row-major, the
  CPU default) or ``dim x rows`` (:attr:`ConvLayout.DS`). A rank's ``dim``
  is its share of each sub-projection, in order (Mamba2: x | B | C; gated
  delta net: Q | K | V), each made of units (heads, or Mamba2's groups) of
  ``width`` channels.
* The recurrent state is heads first: units of ``width`` bytes. A short
  convolution (LFM2) has none.

A rank's units of each part follow :class:`~kvpush.transfer.shares.HeadShare`'s
rule, the one vLLM shards by: contiguous when the TP size divides the
units, one unit per rank and copies of it when the TP size is a multiple
(Mamba2's single group at TP 2: vLLM pads the groups to the TP size).
:meth:`StatePage.pieces` takes each part's
:class:`~kvpush.transfer.shares.TpMapping` for the pair's ranks: in DS a
carried range of units is one piece per part, in SD one per part and row.
Pieces adjacent in both pages merge, so equal TP sizes copy a page as one
piece of its content, and every byte of a decode rank's content has exactly
one writer (:func:`state_writers`). Pure: no vLLM, no memory.
"""

from __future__ import annotations

import enum
import functools
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

from kvpush.transfer.shares import HeadShare, PosInt, TpMapping

Pieces = npt.NDArray[np.int64]
"""``(N, 3)`` int64: ``(source offset, destination offset, length)`` in
bytes from the start of each side's page, by destination offset."""

_MAX_PARTS = 8
_NAME = Annotated[str, msgspec.Meta(max_length=32)]


class ConvLayout(enum.Enum):
    """The conv state's order (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``)."""

    SD = "SD"  # rows x dim
    DS = "DS"  # dim x rows


class StatePart(msgspec.Struct, frozen=True):
    """``units`` units across all ranks, each ``width`` wide (conv:
    channels; recurrent state: bytes)."""

    units: PosInt
    width: PosInt


class StatePage(msgspec.Struct, frozen=True):
    """What a state group's page holds, the same description at every TP
    size (a wire type: in :class:`~kvpush.transfer.layout.KvLayout`).

    ``kind`` names the state (vLLM's Mamba type), ``cache_mode`` vLLM's
    ``mamba_cache_mode`` and ``dtypes`` the states' element types: only
    for the compatibility check (equal descriptions, equal meaning)."""

    kind: _NAME
    cache_mode: _NAME
    conv_layout: ConvLayout
    conv_rows: PosInt
    conv_item_bytes: PosInt
    conv_parts: Annotated[tuple[StatePart, ...], msgspec.Meta(max_length=_MAX_PARTS)]
    recurrent: StatePart | None
    dtypes: Annotated[tuple[_NAME, ...], msgspec.Meta(max_length=_MAX_PARTS)] = ()

    def __post_init__(self) -> None:
        if not self.conv_parts:
            raise ValueError("a state page needs at least one conv part")

    def problem(self, tp_size: int) -> str | None:
        """Why no rank of TP ``tp_size`` holds a share of every part, or None."""
        for part in self._parts:
            try:
                HeadShare(tp_size, 0, part.units)
            except ValueError:
                return (
                    f"a {self.kind} state part of {part.units} units does not "
                    f"split over TP {tp_size}"
                )
        return None

    @property
    def _parts(self) -> tuple[StatePart, ...]:
        extra = () if self.recurrent is None else (self.recurrent,)
        return (*self.conv_parts, *extra)

    def conv_dim(self, tp_size: int) -> int:
        """Channels of one rank's conv state."""
        return sum(_per_rank(p, tp_size) * p.width for p in self.conv_parts)

    def conv_bytes(self, tp_size: int) -> int:
        return self.conv_dim(tp_size) * self.conv_rows * self.conv_item_bytes

    def content_bytes(self, tp_size: int) -> int:
        """One rank's conv and recurrent state, the page's used bytes."""
        if self.recurrent is None:
            return self.conv_bytes(tp_size)
        recurrent = _per_rank(self.recurrent, tp_size) * self.recurrent.width
        return self.conv_bytes(tp_size) + recurrent

    def pieces(self, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int) -> Pieces:
        """The bytes prefill rank ``src_rank`` (of TP ``src_tp``) writes
        into decode rank ``dst_rank``'s page (of TP ``dst_tp``); none when
        that pair carries no unit. ``ValueError`` for a TP size a part does
        not split over or a rank out of range. Worked out once per page
        and rank pair (a few hundred microseconds; every WRITE carrying a
        state and every digest of one asks again): read-only."""
        return _pieces(self, src_tp, src_rank, dst_tp, dst_rank)

    def _work_out_pieces(
        self, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int
    ) -> Pieces:
        rows, item = self.conv_rows, self.conv_item_bytes
        src_dim, dst_dim = self.conv_dim(src_tp), self.conv_dim(dst_tp)
        out: list[tuple[int, int, int]] = []
        src_at = dst_at = 0  # the part's first channel in each side's dim
        for part in self.conv_parts:
            for first_src, first_dst, n in _carried(
                part, src_tp, src_rank, dst_tp, dst_rank
            ):
                a, b = src_at + first_src * part.width, dst_at + first_dst * part.width
                width = n * part.width
                if self.conv_layout is ConvLayout.DS:
                    out.append((a * rows * item, b * rows * item, width * rows * item))
                else:
                    out.extend(
                        (
                            (r * src_dim + a) * item,
                            (r * dst_dim + b) * item,
                            width * item,
                        )
                        for r in range(rows)
                    )
            src_at += _per_rank(part, src_tp) * part.width
            dst_at += _per_rank(part, dst_tp) * part.width
        if self.recurrent is None:
            return _merged(out)
        width = self.recurrent.width
        src_base, dst_base = self.conv_bytes(src_tp), self.conv_bytes(dst_tp)
        for first_src, first_dst, n in _carried(
            self.recurrent, src_tp, src_rank, dst_tp, dst_rank
        ):
            out.append(
                (src_base + first_src * width, dst_base + first_dst * width, n * width)
            )
        return _merged(out)

    def writers_of(self, src_tp: int, dst_tp: int, dst_rank: int) -> frozenset[int]:
        """The prefill ranks that write some of decode rank ``dst_rank``'s page."""
        return frozenset(
            s.src_rank
            for part in self._parts
            for s in TpMapping(src_tp, dst_tp, part.units).slices
            if s.dst_rank == dst_rank
        )


def state_writers_problem(
    page: StatePage, src_tp: int, dst_tp: int, kv_writers: list[frozenset[int]]
) -> str | None:
    """Why decode of TP ``dst_tp`` cannot take ``page`` from prefill of TP
    ``src_tp``, or None. ``kv_writers[d]`` are the prefill ranks decode rank
    ``d`` hears a Done from (the KV heads' mapping): a state piece from any
    other rank would never be written, so it must be one of them."""
    for tp in (src_tp, dst_tp):
        problem = page.problem(tp)
        if problem is not None:
            return problem
    for d in range(dst_tp):
        extra = page.writers_of(src_tp, dst_tp, d) - kv_writers[d]
        if extra:
            return (
                f"decode rank {d}'s {page.kind} state needs prefill rank(s) "
                f"{sorted(extra)}, which write it no KV heads (prefill TP "
                f"{src_tp}, decode TP {dst_tp})"
            )
    return None


@functools.lru_cache(maxsize=256)
def _pieces(
    page: StatePage, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int
) -> Pieces:
    out = page._work_out_pieces(src_tp, src_rank, dst_tp, dst_rank)
    out.flags.writeable = False
    return out


def _per_rank(part: StatePart, tp_size: int) -> int:
    return HeadShare(tp_size, 0, part.units).num_heads


def _carried(
    part: StatePart, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int
) -> list[tuple[int, int, int]]:
    """``(first unit in the source rank, first in the destination, count)``
    of each range of ``part`` the pair carries."""
    mapping = TpMapping(src_tp, dst_tp, part.units)
    mapping.prefill_share(src_rank)  # ValueError out of range
    mapping.decode_share(dst_rank)
    return [
        (s.src_heads.start, s.dst_heads.start, s.num_heads)
        for s in mapping.slices
        if s.src_rank == src_rank and s.dst_rank == dst_rank
    ]


def _merged(pieces: list[tuple[int, int, int]]) -> Pieces:
    """``pieces`` by destination offset, runs adjacent on both sides joined."""
    out: list[list[int]] = []
    for src, dst, n in sorted(pieces, key=lambda p: p[1]):
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1][2] += n
        else:
            out.append([src, dst, n])
    return np.asarray(out, dtype=np.int64).reshape(-1, 3)
