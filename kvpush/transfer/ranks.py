"""Tensor-parallel ranks as transfer endpoints: which rank talks to which.

vLLM runs one Worker process per TP rank, each holding its own slice of the
KV cache, so every worker rank is a kvpush endpoint of its own:

* rank ``r`` of an instance has its own NIXL agent,
  :func:`agent_name` ``(engine_id, r)``, over its own registered memory;
* prefill rank ``r`` listens on its own side channel,
  :func:`side_channel_port` ``(base, r)`` = ``base + r``, where ``base`` is
  the instance's ``side_channel_port`` (the launcher gives each instance a
  range of ``tp_size`` ports, ranges not overlapping); a data-parallel
  instance's engine ``d`` is an instance of its own whose ``base`` is
  :func:`dp_engine_port` ``(first, d, tp_size)`` = ``first + d * tp_size``.

Which rank pairs exchange KV, and which heads, is decided here only, by
:class:`TpPair` over :class:`~kvpush.transfer.shares.TpMapping`:
:meth:`TpPair.targets_of` (the decode ranks a prefill rank writes to, each
with its :class:`~kvpush.transfer.shares.HeadSlice`) and
:meth:`TpPair.sources_of` (the prefill ranks a decode rank must hear a
final word from). Equal TP sizes map rank ``r`` to rank ``r`` (whole
blocks); different ones need the model's total KV heads, both sides' from
their own vLLM config, and a head-separable layout
(:meth:`TpPair.problem`). Pure: no vLLM, no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvpush.transfer.heads import head_split_problem
from kvpush.transfer.shares import HeadSlice, TpMapping

MAX_TP_SIZE = 64  # the largest tensor-parallel size the wire accepts


def side_channel_port(base: int, rank: int) -> int:
    """The side-channel port prefill rank ``rank`` listens on."""
    return base + rank


def dp_engine_port(first: int, dp_rank: int, tp_size: int) -> int:
    """The first side-channel port of data-parallel engine ``dp_rank`` of an
    instance whose ports start at ``first``: after the TP ranks of the
    engines before it."""
    return first + dp_rank * tp_size


def agent_name(engine_id: str, rank: int) -> str:
    """The NIXL agent name of rank ``rank`` of engine ``engine_id``."""
    return f"kvpush-{engine_id}-rank{rank}"


@dataclass(frozen=True)
class TpPair:
    """The TP sizes of one prefill instance and one decode instance, and the
    model's KV heads in total (0: unknown, which pairs equal sizes only)."""

    prefill_tp: int
    decode_tp: int
    total_kv_heads: int = 0

    def __post_init__(self) -> None:
        for name in ("prefill_tp", "decode_tp"):
            size = getattr(self, name)
            if not 1 <= size <= MAX_TP_SIZE:
                raise ValueError(f"{name} must be in 1..{MAX_TP_SIZE}, not {size}")
        if self.total_kv_heads < 0:
            raise ValueError(f"total_kv_heads must be >= 0, not {self.total_kv_heads}")

    @property
    def is_homogeneous(self) -> bool:
        return self.prefill_tp == self.decode_tp

    def problem(self, cache_layout: str = "LBHNC") -> str | None:
        """Why kvpush cannot transfer between these sizes (KV heads that
        divide neither way, a layout whose heads are not one range per
        block), or None."""
        if self.is_homogeneous:
            return None
        if not self.total_kv_heads:
            return (
                f"prefill TP {self.prefill_tp} and decode TP {self.decode_tp} "
                "differ and the model's number of KV heads is unknown here"
            )
        try:
            mapping = self.mapping
        except ValueError as e:
            return str(e)
        return head_split_problem(mapping, cache_layout)

    @cached_property
    def mapping(self) -> TpMapping:
        """The head mapping; with equal sizes and heads unknown, one whole
        block per rank (rank ``r`` to rank ``r``). ``ValueError`` when the
        sizes do not fit the heads."""
        if self.is_homogeneous and not self.total_kv_heads:
            return TpMapping(self.prefill_tp, self.decode_tp, self.prefill_tp)
        if not self.total_kv_heads:
            raise ValueError(self.problem())
        return TpMapping(self.prefill_tp, self.decode_tp, self.total_kv_heads)

    def targets_of(self, prefill_rank: int) -> tuple[HeadSlice, ...]:
        """What prefill rank ``prefill_rank`` writes, by decode rank (empty:
        a replicated copy nobody reads from; it writes nothing)."""
        self._check(prefill_rank, self.prefill_tp)
        return self.mapping.transfers_from(prefill_rank)

    def target_ranks(self, prefill_rank: int) -> frozenset[int]:
        return frozenset(s.dst_rank for s in self.targets_of(prefill_rank))

    def sources_of(self, decode_rank: int) -> frozenset[int]:
        """The prefill ranks whose final word decode rank ``decode_rank``
        needs before its receive is over."""
        self._check(decode_rank, self.decode_tp)
        return self.mapping.writers_of(decode_rank)

    def _check(self, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside TP size {size}")
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)
