"""The only module that touches NIXL: one agent per worker, its KV memory
registered once, remote agents loaded once per peer, WRITEs posted and
polled, notifications read. Accelerator-agnostic: memory is registered as
host (DRAM) or device (VRAM) memory according to where vLLM put the cache.

Handles: once ``initialize_xfer`` returned a handle for a WRITE, that
handle is the caller's until NIXL released it, whatever ``transfer`` said
(``ERR``) or raised: the backend may have posted part of the WRITE, which
can still land. Nothing here releases a handle on its own; a WRITE NIXL
refused at post time comes back as :class:`WriteRefused`, carrying it.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from kvpush.nixl_build import nixl_api
from kvpush.transfer.coalesce import Descs
from kvpush.transfer.layout import KvLayout

logger = logging.getLogger(__name__)


class XferState(enum.Enum):
    """NIXL's transfer states, as ``check_xfer_state`` spells them."""

    PROC = "PROC"  # still running
    DONE = "DONE"  # complete, notification delivered
    ERR = "ERR"  # failed (the backend may still touch the memory until released)


class WriteRefused(RuntimeError):
    """NIXL gave a WRITE a handle but refused to run it (``transfer`` said
    ``ERR`` or raised). The handle is not released: the caller owns it, as
    for any WRITE that failed in flight, until :meth:`NixlIO.release`
    returns True."""

    def __init__(self, handle: Any, reason: str) -> None:
        super().__init__(reason)
        self.handle = handle


def memory_type(device_type: str) -> str:
    """NIXL's memory kind for a tensor on ``device_type``."""
    return "DRAM" if device_type == "cpu" else "VRAM"


class NixlIO:
    """A NIXL agent with this worker's KV cache registered.

    Built by the worker in ``register_kv_caches``; afterwards used by exactly
    one thread per role (prefill: the writer thread; decode: its NIXL
    progress thread, :mod:`kvpush.connector.decode.progress`, the only
    reader of notifications, while the main thread only opens the agent
    and, once that thread stopped, closes it). The agent has no locks of
    its own (NIXL's sync mode "none"). Progress is driven by those threads'
    polling; NIXL's own progress thread is off.
    """

    def __init__(
        self, name: str, layout: KvLayout, mem_type: str, backend: str = "UCX"
    ) -> None:
        api = nixl_api()  # imports NIXL
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        self.name = name
        self.layout = layout
        self.mem_type = mem_type
        self._agent = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=False, backends=[backend])
        )
        span = layout.num_blocks * layout.block_bytes
        regions = [(addr, span, layout.device_id, "") for addr in layout.base_addrs]
        self._reg = self._agent.get_reg_descs(regions, mem_type)
        self._agent.register_memory(self._reg)
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._remotes: dict[str, bytes] = {}  # loaded agent name -> metadata

    def load_peer(self, agent_name: str, metadata: bytes) -> str:
        """Load a remote agent's metadata, once per peer process: the same
        metadata again (a decode that reconnected, or said Hello after
        prefill had dropped it as silent) keeps the loaded agent and its
        connection. Other metadata under a loaded name is a new process of
        that peer (a restart): the old agent is replaced."""
        if self._remotes.get(agent_name) == metadata:
            return agent_name
        if agent_name in self._remotes:
            self._agent.remove_remote_agent(agent_name)
            del self._remotes[agent_name]
        name: str = self._agent.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode()
        self._remotes[name] = metadata
        return name

    def write(self, src: Descs, dst: Descs, peer: str, notif: bytes) -> Any:
        """Post one WRITE of ``src`` into ``peer``'s ``dst`` (parallel arrays
        from :func:`kvpush.transfer.coalesce.descriptors`, which NIXL reads
        without a copy); the peer receives ``notif`` when all of it has
        landed. Returns its handle. Raises :class:`WriteRefused`, carrying
        the handle (still held: see the module docstring), when ``transfer``
        says ``ERR`` or raises; any other exception (from the descriptors or
        ``initialize_xfer``) means no handle exists."""
        src_descs = self._agent.get_xfer_descs(src, self.mem_type)
        dst_descs = self._agent.get_xfer_descs(dst, self.mem_type)
        handle = self._agent.initialize_xfer("WRITE", src_descs, dst_descs, peer, notif)
        try:
            state = self._agent.transfer(handle)
        except Exception as e:
            raise WriteRefused(handle, f"NIXL refused the WRITE to {peer}: {e}") from e
        if state == "ERR":
            raise WriteRefused(handle, f"NIXL refused the WRITE to {peer}")
        return handle

    def state(self, handle: Any) -> XferState:
        """Where a posted WRITE is. A peer that vanished mid-transfer makes
        NIXL raise (e.g. ``nixlRemoteDisconnectError``) instead of returning
        ``ERR``: that is ``ERR`` too. Never releases the handle: ``ERR``
        does not prove the backend stopped touching the memory."""
        try:
            raw = self._agent.check_xfer_state(handle)
        except Exception as e:
            logger.warning("kvpush: NIXL state check failed: %s", e)
            return XferState.ERR
        try:
            return XferState(raw)
        except ValueError:
            logger.warning("kvpush: NIXL returned unknown state %r", raw)
            return XferState.ERR

    def release(self, handle: Any) -> bool:
        """Release a handle; for a WRITE still running this asks NIXL to
        cancel it. True once NIXL released it (the transfer no longer
        touches either memory); False if it refused or raised, and the
        handle is still owned by the caller."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            logger.warning("kvpush: NIXL could not release a WRITE: %s", e)
            return False
        return True

    def notifications(self) -> list[bytes]:
        """Notification payloads received since the last call."""
        notifs = self._agent.get_new_notifs()
        return [msg for msgs in notifs.values() for msg in msgs]

    def close(self) -> None:
        try:
            for name in self._remotes:
                self._agent.remove_remote_agent(name)
            self._agent.deregister_memory(self._reg)
        except Exception as e:  # shutting down: log, never raise
            logger.warning("kvpush: NIXL clean-up failed: %s", e)
