"""The decodes a prefill writer pushes to: for each decode engine its NIXL
agent, KV layout, reply route and boot id (from its Hello), and when it was
last heard from. Owned by the writer thread; bookkeeping only (loading a
peer's NIXL metadata is the caller's ``load`` function)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kvpush.transfer.layout import KvLayout, compat_problem
from kvpush.transfer.messages import Hello, Registration


@dataclass(frozen=True)
class DecodePeer:
    agent_name: str
    layout: KvLayout
    route: bytes  # the decode worker's side-channel socket, for replies
    boot_id: str
    metadata: bytes


class DecodePeers:
    """Known decodes, by engine id, and their liveness."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._peers: dict[str, DecodePeer] = {}
        self._last_seen: dict[str, float] = {}

    def get(self, engine_id: str) -> DecodePeer | None:
        return self._peers.get(engine_id)

    def accept(
        self,
        hello: Hello,
        route: bytes,
        local: KvLayout,
        load: Callable[[str, bytes], str],
    ) -> str | None:
        """Take a decode's Hello (from socket ``route``): why it is refused,
        or None once the peer is known (its metadata loaded with ``load``,
        or, for the same agent seen again, only its route updated). A known
        peer of another boot must have been forgotten first."""
        problem = compat_problem(local, hello.layout)
        if problem is not None:
            return problem
        known = self._peers.get(hello.engine_id)
        if known is not None and known.metadata == hello.nixl_metadata:
            self.reroute(hello.engine_id, route)  # same decode, new socket
            return None
        try:
            agent = load(hello.agent_name, hello.nixl_metadata)
        except Exception as e:  # bad metadata is the peer's problem
            return f"cannot load NIXL metadata: {e}"
        peer = DecodePeer(
            agent, hello.layout, route, hello.boot_id, hello.nixl_metadata
        )
        self._peers[hello.engine_id] = peer
        return None

    def reroute(self, engine_id: str, route: bytes) -> None:
        """The same decode said hello again from another socket."""
        self._peers[engine_id] = replace(self._peers[engine_id], route=route)

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
        """Drop the peer (a later Hello loads it afresh); a dead one's
        liveness too."""
        self._peers.pop(engine_id, None)
        if dead:
            self._last_seen.pop(engine_id, None)

    def range_problem(self, reg: Registration) -> str | None:
        """Blocks beyond the cache of the decode boot that registered them
        (checkable once that boot said hello; otherwise None)."""
        peer = self._peers.get(reg.decode_engine_id)
        if peer is None or peer.boot_id != reg.decode_boot_id:
            return None
        if max(reg.dst_block_ids) < peer.layout.num_blocks:
            return None
        return f"destination blocks beyond decode's {peer.layout.num_blocks}"

    def knows(self, engine_id: str, boot_id: str) -> bool:
        """Whether that decode boot said Hello (and was not forgotten)."""
        peer = self._peers.get(engine_id)
        return peer is not None and peer.boot_id == boot_id
