"""The decodes a prefill writer pushes to: for each decode worker rank, by
(engine id, rank), its NIXL agent, KV layout, reply route and boot id (from
its Hello), and for each engine when it was last heard from (any of its
ranks). Owned by the writer thread; bookkeeping only (loading a peer's NIXL
metadata is the caller's ``load`` function)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpush.transfer import groups
from kvpush.transfer.heads import slice_problem
from kvpush.transfer.layout import REQUIRED_KV_CACHE_LAYOUT, KvLayout, compat_problem
from kvpush.transfer.messages import Hello, Registration
from kvpush.transfer.ranks import TpPair
from kvpush.transfer.shares import HeadSlice

PeerKey = tuple[str, int]  # (decode engine id, decode worker rank)


@dataclass(frozen=True)
class DecodePeer:
    agent_name: str
    layout: KvLayout
    route: bytes  # the decode worker's side-channel socket, for replies
    boot_id: str


class DecodePeers:
    """Known decode ranks, by (engine id, rank), and each engine's liveness."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._peers: dict[PeerKey, DecodePeer] = {}
        self._last_seen: dict[str, float] = {}

    def get(self, engine_id: str, rank: int | None = None) -> DecodePeer | None:
        """Decode rank ``rank`` of ``engine_id`` (None: any of its ranks)."""
        if rank is not None:
            return self._peers.get((engine_id, rank))
        return next((p for k, p in self._peers.items() if k[0] == engine_id), None)

    def accept(
        self,
        hello: Hello,
        route: bytes,
        local: KvLayout,
        load: Callable[[str, bytes], str],
        head_slice: HeadSlice,
    ) -> str | None:
        """Take a decode rank's Hello (from socket ``route``), to which this
        rank writes ``head_slice``: why it is refused, or None once the peer
        is known, replies going to ``route`` (its metadata loaded with
        ``load``, which keeps an agent already loaded from the same process:
        :meth:`~kvpush.connector.nixl_io.NixlIO.load_peer`). A known peer of
        another boot must have been forgotten first."""
        if head_slice.is_whole_block:
            problem = compat_problem(local, hello.layout)
        else:
            problem = slice_problem(local, hello.layout, head_slice)
        if problem is not None:
            return problem
        key = (hello.engine_id, hello.rank)
        try:
            agent = load(hello.agent_name, hello.nixl_metadata)
        except Exception as e:  # bad metadata is the peer's problem
            return f"cannot load NIXL metadata: {e}"
        self._peers[key] = DecodePeer(agent, hello.layout, route, hello.boot_id)
        return None

    def heard(self, engine_id: str, now: float) -> None:
        """Any message from ``engine_id`` (decodes beat every second while
        they wait on transfers)."""
        self._last_seen[engine_id] = now

    def silent(self, engine_ids: set[str], now: float) -> set[str]:
        """Those of ``engine_ids`` not heard from for the timeout."""
        return {
            e for e in engine_ids if now - self._last_seen.get(e, now) > self.timeout_s
        }

    def pardon(self, now: float) -> None:
        """This process was stopped (its own clock jumped): nobody is blamed
        for the gap; every known decode counts as just heard from."""
        for engine_id in self._last_seen:
            self._last_seen[engine_id] = now

    def forget(self, engine_id: str, dead: bool) -> None:
        """Drop every rank of the peer (a later Hello loads it afresh); a
        dead one's liveness too."""
        for key in [k for k in self._peers if k[0] == engine_id]:
            del self._peers[key]
        if dead:
            self._last_seen.pop(engine_id, None)

    def range_problem(self, reg: Registration) -> str | None:
        """Blocks beyond the cache of the decode boot that registered them
        (checkable once that boot said hello; otherwise None)."""
        peer = self.get(reg.decode_engine_id)
        if peer is None or peer.boot_id != reg.decode_boot_id:
            return None
        if max(groups.flat(reg.dst_block_ids)) < peer.layout.num_blocks:
            return None
        return f"destination blocks beyond decode's {peer.layout.num_blocks}"

    def knows(self, engine_id: str, boot_id: str, ranks: frozenset[int]) -> bool:
        """Whether every one of ``ranks`` of that decode boot said Hello
        (and was not forgotten)."""
        for rank in ranks:
            peer = self._peers.get((engine_id, rank))
            if peer is None or peer.boot_id != boot_id:
                return False
        return True


def hello_slice(
    hello: Hello, tp_size: int, rank: int, total_kv_heads: int
) -> tuple[str | None, HeadSlice | None]:
    """What prefill rank ``rank`` of ``tp_size`` writes to the decode rank
    that said ``hello`` (:class:`~kvpush.transfer.ranks.TpPair`), or why it
    writes nothing: (problem, None) or (None, its head slice)."""
    mine, theirs = total_kv_heads, hello.total_kv_heads
    if mine and theirs and mine != theirs:
        return (
            f"the model's KV heads differ: prefill has {mine}, decode "
            f"{theirs} (serve the same model on both)",
            None,
        )
    pair = TpPair(tp_size, hello.tp_size, mine if mine == theirs else 0)
    problem = pair.problem(REQUIRED_KV_CACHE_LAYOUT)
    if problem is not None:
        return problem, None
    for head_slice in pair.targets_of(rank):
        if head_slice.dst_rank == hello.rank:
            return None, head_slice
    return (
        f"prefill rank {rank} does not write to decode rank "
        f"{hello.rank} (a decode rank says Hello only to its sources)",
        None,
    )
