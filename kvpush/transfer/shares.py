"""Which TP rank holds which units (KV heads, state heads or groups), and
which prefill rank writes which of them to which decode rank.

With tensor parallelism each worker rank holds a share of a model's units
(:class:`HeadShare`): its KV heads, or a state layer's heads and groups
(:mod:`kvpush.transfer.state_pages`). A prefill instance of TP ``P`` pushes
to a decode instance of TP ``D``; :class:`TpMapping` says, for ``(P, D,
U)`` with ``U`` units in total, which (prefill rank, decode rank) pairs
exist and which units each carries (:class:`HeadSlice`). Pure: both sides
compute the same mapping from the TP sizes and unit counts their Hellos
carry.

* ``T <= U``: rank ``r`` holds units ``[r*U/T, (r+1)*U/T)``; ``T > U``
  (replication; ``T`` a multiple of ``U``): rank ``r`` holds the one unit
  ``r // (T/U)``, and ``T/U`` ranks hold identical copies of it.
* Every unit of every decode rank is written by exactly one prefill rank.
  When prefill replicates a unit (``P > U``, ``R = P/U`` copies), decode
  rank ``d`` takes it from copy ``d mod R``: equal TP sizes map rank ``i``
  to rank ``i``, and the writes spread round-robin over the copies.
* A pair carries one contiguous range of global units.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Annotated

import msgspec

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


class HeadShare(msgspec.Struct, frozen=True):
    """The KV heads one rank of a TP group holds (a wire type: a rank's
    Hello can carry it).

    ``ValueError`` at construction (failed decoding when received) unless
    ``tp_size`` divides ``total_kv_heads`` or is a multiple of it, and
    ``0 <= tp_rank < tp_size``."""

    tp_size: PosInt
    tp_rank: NonNegInt
    total_kv_heads: PosInt

    def __post_init__(self) -> None:
        size, heads = self.tp_size, self.total_kv_heads
        if size < 1 or heads < 1:
            raise ValueError(
                f"tp_size and total_kv_heads must be >= 1, got {size}, {heads}"
            )
        if heads % size and size % heads:
            raise ValueError(
                f"tensor-parallel size {size} must divide the model's {heads} KV "
                f"heads or be a multiple of them; pick a TP size that does"
            )
        if not 0 <= self.tp_rank < size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside 0..{size - 1}")

    @property
    def is_replicated(self) -> bool:
        """More ranks than heads: this rank's one head has other copies."""
        return self.tp_size > self.total_kv_heads

    @property
    def num_replicas(self) -> int:
        """How many ranks hold each of this rank's heads (1 without GQA copies)."""
        return max(1, self.tp_size // self.total_kv_heads)

    @property
    def num_heads(self) -> int:
        return max(1, self.total_kv_heads // self.tp_size)

    @property
    def first_head(self) -> int:
        return self.tp_rank // self.num_replicas * self.num_heads

    @property
    def heads(self) -> range:
        """Global indices of the heads this rank holds, in block order."""
        return range(self.first_head, self.first_head + self.num_heads)


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Global heads ``[first_head, first_head + num_heads)`` copied from the
    ``src`` rank's blocks to the ``dst`` rank's blocks."""

    src: HeadShare
    dst: HeadShare
    first_head: int
    num_heads: int

    def __post_init__(self) -> None:
        heads = self.heads
        for side in (self.src, self.dst):
            if heads.start < side.first_head or heads.stop > side.heads.stop:
                raise ValueError(f"heads {heads} are not all held by {side}")

    @property
    def src_rank(self) -> int:
        return self.src.tp_rank

    @property
    def dst_rank(self) -> int:
        return self.dst.tp_rank

    @property
    def heads(self) -> range:
        """Global head indices carried."""
        return range(self.first_head, self.first_head + self.num_heads)

    @property
    def src_heads(self) -> range:
        """The carried heads as positions within the source rank's block."""
        start = self.first_head - self.src.first_head
        return range(start, start + self.num_heads)

    @property
    def dst_heads(self) -> range:
        """The carried heads as positions within the destination rank's block."""
        start = self.first_head - self.dst.first_head
        return range(start, start + self.num_heads)

    @property
    def is_whole_block(self) -> bool:
        """Both sides' blocks are copied whole (so runs coalesce)."""
        return self.num_heads == self.src.num_heads == self.dst.num_heads


@dataclass(frozen=True)
class TpMapping:
    """The rank-to-rank head mapping from a prefill TP group to a decode one.

    ``ValueError`` at construction when either TP size fits ``total_kv_heads``
    neither way (see :class:`HeadShare`)."""

    prefill_tp: int
    decode_tp: int
    total_kv_heads: int

    def __post_init__(self) -> None:
        self.prefill_share(0)
        self.decode_share(0)

    def prefill_share(self, rank: int) -> HeadShare:
        return HeadShare(self.prefill_tp, rank, self.total_kv_heads)

    def decode_share(self, rank: int) -> HeadShare:
        return HeadShare(self.decode_tp, rank, self.total_kv_heads)

    @property
    def is_homogeneous(self) -> bool:
        return self.prefill_tp == self.decode_tp

    @cached_property
    def slices(self) -> tuple[HeadSlice, ...]:
        """Every pair's slice, by decode rank, then head: each head of each
        decode rank appears in exactly one."""
        return tuple(s for d in range(self.decode_tp) for s in self._into(d))

    @property
    def splits_heads(self) -> bool:
        """Some pair copies only part of a block (needs head-separable blocks)."""
        return not all(s.is_whole_block for s in self.slices)

    def transfers_from(self, prefill_rank: int) -> tuple[HeadSlice, ...]:
        """What prefill rank ``prefill_rank`` pushes, by decode rank."""
        self.prefill_share(prefill_rank)
        return tuple(s for s in self.slices if s.src_rank == prefill_rank)

    def writers_of(self, decode_rank: int) -> frozenset[int]:
        """The prefill ranks whose Done decode rank ``decode_rank`` waits for."""
        self.decode_share(decode_rank)
        return frozenset(s.src_rank for s in self.slices if s.dst_rank == decode_rank)

    def writer(self, head: int, decode_rank: int) -> int:
        """The one prefill rank that writes ``head`` to ``decode_rank``:
        copy ``decode_rank mod R`` of the ``R`` prefill ranks holding it."""
        if head not in self.decode_share(decode_rank).heads:
            raise ValueError(f"decode rank {decode_rank} does not hold head {head}")
        share = self.prefill_share(0)
        copies = share.num_replicas
        return head // share.num_heads * copies + decode_rank % copies

    def _into(self, decode_rank: int) -> list[HeadSlice]:
        """Decode rank ``decode_rank``'s heads, grouped by writer."""
        dst = self.decode_share(decode_rank)
        out: list[HeadSlice] = []
        for head in dst.heads:
            src = self.prefill_share(self.writer(head, decode_rank))
            if out and out[-1].src == src:
                last = out[-1]
                out[-1] = HeadSlice(src, dst, last.first_head, last.num_heads + 1)
            else:
                out.append(HeadSlice(src, dst, head, 1))
        return out
