"""Tensor-parallel ranks as transfer endpoints: which rank talks to which.

vLLM runs one Worker process per TP rank, each holding its own slice of the
KV cache, so every worker rank is a kvpush endpoint of its own:

* rank ``r`` of an instance has its own NIXL agent,
  :func:`agent_name` ``(engine_id, r)``, over its own registered memory;
* prefill rank ``r`` listens on its own side channel,
  :func:`side_channel_port` ``(base, r)`` = ``base + r``, where ``base`` is
  the instance's ``side_channel_port`` (the launcher gives each instance a
  range of ``tp_size`` ports, ranges not overlapping).

Which rank pairs exchange KV is decided here only, by :class:`TpPair`:
:meth:`TpPair.targets_of` (the decode ranks a prefill rank writes to) and
:meth:`TpPair.sources_of` (the prefill ranks a decode rank must hear a
final word from). Homogeneous TP (prefill TP = decode TP) maps rank ``r``
to rank ``r``; any other pair is refused (:meth:`TpPair.problem`) until the
head-slice mapping for heterogeneous TP lands, which replaces these two
functions and nothing else. Pure: no vLLM, no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TP_SIZE = 64  # the largest tensor-parallel size the wire accepts


def side_channel_port(base: int, rank: int) -> int:
    """The side-channel port prefill rank ``rank`` listens on."""
    return base + rank


def agent_name(engine_id: str, rank: int) -> str:
    """The NIXL agent name of rank ``rank`` of engine ``engine_id``."""
    return f"kvpush-{engine_id}-rank{rank}"


@dataclass(frozen=True)
class TpPair:
    """The TP sizes of one prefill instance and one decode instance."""

    prefill_tp: int
    decode_tp: int

    def __post_init__(self) -> None:
        for name in ("prefill_tp", "decode_tp"):
            size = getattr(self, name)
            if not 1 <= size <= MAX_TP_SIZE:
                raise ValueError(f"{name} must be in 1..{MAX_TP_SIZE}, not {size}")

    def problem(self) -> str | None:
        """Why kvpush cannot transfer between these sizes, or None."""
        if self.prefill_tp == self.decode_tp:
            return None
        return (
            f"heterogeneous tensor parallelism is not yet supported (prefill "
            f"TP {self.prefill_tp}, decode TP {self.decode_tp}); run both "
            "sides with the same --tensor-parallel-size"
        )

    def targets_of(self, prefill_rank: int) -> tuple[int, ...]:
        """The decode ranks prefill rank ``prefill_rank`` writes to."""
        self._check(prefill_rank, self.prefill_tp)
        return (prefill_rank,)

    def sources_of(self, decode_rank: int) -> tuple[int, ...]:
        """The prefill ranks whose final word decode rank ``decode_rank``
        needs before its receive is over."""
        self._check(decode_rank, self.decode_tp)
        return (decode_rank,)

    def _check(self, rank: int, size: int) -> None:
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside TP size {size}")
