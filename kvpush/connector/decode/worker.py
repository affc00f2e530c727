"""Decode's worker side (vLLM's Worker process; every method is called by
vLLM on the worker's main thread, except the heartbeat and NIXL progress
threads' own loops).

``register_kv_caches`` registers the KV cache with NIXL and starts the
progress thread (:mod:`kvpush.connector.decode.progress`), the only reader
of NIXL notifications from then on. Decode says Hello to each prefill it
meets (again after a reconnect, or when that prefill asks), watches those
connections, reconciles with a prefill whose connection came back off
loopback (a ``Reconcile`` after its HelloReply), keeps a heartbeat thread
beating to the prefills it waits on, takes the notifications (Done) the
progress thread read and prefill's Done and Failures (on its own socket,
and those its scheduler forwards), and reports each receive finished
(``get_finished``) by the rule of :mod:`kvpush.connector.decode.receiver`;
blocks of a failed receive are reported as load errors so that vLLM does
not use them.

Tensor parallelism: this is one decode worker rank, with its own agent
(:func:`kvpush.transfer.ranks.agent_name`). Every rank gets the same
metadata; each says Hello (naming its rank and TP size) only to the
prefill ranks it receives from (:meth:`Receiver.sources`), and beats,
cancels and reconciles with those only.

Proof from an operator (``control_dir``): once a step, at most every
0.5 s, the worker looks for new ``kvpush forget`` files
(:mod:`kvpush.connector.control`) and treats the prefill engine each
names as proven gone, every rank of it, as a closed loopback connection
would: its receives pending at that moment fail and their quarantined
blocks are released. A forget is spent once read; it spares a rank whose
current boot decode first heard after the forget was written (the prefill
came back), and receives registered later are not touched.

KV digests (``verify_kv``): the Done of a selected transfer is checked
before the receive counts as done, on the ``kvpush-verify`` thread
(:mod:`kvpush.connector.decode.verify`); ``get_finished`` only hands the
checks over and takes the verdicts, so the engine step never waits for a
hash.
"""

from __future__ import annotations

import ipaddress
import logging
import time

import torch

from kvpush.connector.agent import open_agent
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.control import ControlDir, Forget
from kvpush.connector.counters import Counters
from kvpush.connector.decode.heartbeat import Heartbeats
from kvpush.connector.decode.progress import Progress
from kvpush.connector.decode.receiver import Receiver
from kvpush.connector.decode.verify import Verifier
from kvpush.connector.faults import FaultSource
from kvpush.connector.kv_bytes import TensorBytes
from kvpush.connector.kv_memory import without_states
from kvpush.connector.metadata import DecodeMetadata
from kvpush.connector.nixl_io import NixlIO
from kvpush.connector.side_channel import Peers
from kvpush.connector.trace import Tracer
from kvpush.transfer.messages import (
    MAX_IDS_PER_MESSAGE,
    Cancel,
    Done,
    Failure,
    Hello,
    HelloReply,
    HelloRequest,
    ProtocolError,
    Reconcile,
    decode,
)

logger = logging.getLogger(__name__)

STALL_S = 2.0  # a gap this long between two steps: do not blame prefill for it

Address = tuple[str, int]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback (an address or localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DecodeWorker:
    """Owns decode's worker-side state (main thread)."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        self.tracer = Tracer(config.trace_dir, config.engine_id)
        self.counters = Counters()
        self._io: NixlIO | None = None
        self._progress: Progress | None = None  # started with the agent
        self._peers = Peers(config.secret, monitor=True)  # watched for liveness
        self._hello: Hello | None = None
        self._greeted: set[Address] = set()  # Hello sent since (re)connect
        self._connected: set[Address] = set()
        self._prefill_boots: dict[Address, str] = {}  # from their HelloReply
        # wall-clock time each of those boots was first heard (forget's guard)
        self._boot_since: dict[Address, float] = {}
        # Off loopback, each prefill whose connection went down, with the
        # receives awaited from it then (:meth:`_reconcile`).
        self._to_reconcile: dict[Address, set[str]] = {}
        self._receiver = Receiver(
            config.registration_ttl_s,
            self.counters,
            config.tp_rank,
            config.tp_size,
            config.total_kv_heads,
            verify=config.verify,
        )
        self._verifier: Verifier | None = None  # made with the agent
        self._heartbeats = Heartbeats(
            config.engine_id,
            config.boot_id,
            config.secret,
            config.heartbeat_s,
            self.counters,
        )
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()
        self._last_step = time.monotonic()
        self._control = ControlDir(config.control_dir)
        self._control.prepare()
        self._quarantined: dict[str, int] = {}  # by prefill, as last reported

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._io = open_agent(self.config, kv_caches)
        kv_caches = without_states(kv_caches, self.config.kv_groups)  # mapped
        self._progress = Progress(self._io, self.counters)
        self._verifier = Verifier(
            self._io.layout,
            TensorBytes(kv_caches, self._io.layout),
            self.config.tp_rank,
            self.config.tp_size,
            self.config.total_kv_heads,
            FaultSource(self.config.fault_file),
        )
        self._hello = Hello(
            engine_id=self.config.engine_id,
            boot_id=self.config.boot_id,
            agent_name=self._io.name,
            nixl_metadata=self._io.metadata,
            layout=self._io.layout,
            rank=self.config.tp_rank,
            tp_size=self.config.tp_size,
            total_kv_heads=self.config.total_kv_heads,
        )

    def bind(self, meta: DecodeMetadata) -> None:
        """Take this step's instructions (before the forward)."""
        now = time.monotonic()
        # Connection news, read here once per step: it predates these
        # expects (e.g. a prefill that died and came back while this engine
        # was idle) and must not fail them.
        self._watch_connections()
        for expect in meta.expects:
            self._receiver.expect(expect, now, self._prefill_boots)
            self.tracer.mark(
                expect.transfer_id, "recv_expected", peer=expect.prefill_engine_id
            )
            for address in self._receiver.sources(expect):
                self._greet(address)
        for f in meta.failures:  # from any prefill rank
            self._receiver.failed(f.transfer_id, f.cause, f.rank, now)
        awaited = self._receiver.awaited()
        for address in meta.hello_requests:
            if address in awaited:  # not another decode rank's prefill rank
                self._greeted.discard(address)  # that prefill forgot us
                self._greet(address)
        for tid in meta.recv_cancels:  # prefill answers with its final word
            self._receiver.abort(tid)
        self._ask_final_words()
        self._heartbeats.set_targets(self._receiver.awaited())
        self._want_progress()

    def _want_progress(self) -> None:
        """NIXL is read while a receive is pending, not otherwise."""
        if self._progress is not None:
            self._progress.want(self._receiver.pending() > 0)

    def _greet(self, address: Address) -> None:
        """Say Hello to a prefill once per connection."""
        if address in self._greeted or self._hello is None:
            return
        if self._peers.send(*address, self._hello):
            self._greeted.add(address)

    def _ask_final_words(self) -> None:
        """Send the Cancels the receiver asks for: each awaited prefill rank
        answers with its final word."""
        for ask in self._receiver.take_asks():
            cancel = Cancel(
                transfer_id=ask.expect.transfer_id,
                engine_id=self.config.engine_id,
                reason=ask.reason,
            )
            for address in ask.addresses:
                if not self._peers.send(*address, cancel):
                    self.counters.add("cancel.not_sent")

    def get_finished(self) -> set[str]:
        """Decode requests whose KV has arrived or has failed."""
        if self._progress is None:
            return set()
        now = time.monotonic()
        if now - self._last_step > STALL_S:
            self._receiver.pardon(now - self._last_step)
        self._last_step = now
        for payload in self._progress.take():
            try:
                msg = decode(payload)
            except ProtocolError as e:
                self.counters.add(f"rejected.{e.kind}")
                logger.warning("kvpush: dropped a notification: %s", e.reason)
                continue
            if isinstance(msg, Done):
                self.tracer.mark(msg.transfer_id, "notif_received")
                self._receiver.done(msg.transfer_id, msg.rank, now, msg.digest)
        self._read_replies(now)
        self._read_control(now)
        self._verify()
        self._receiver.expire(now)
        self._ask_final_words()
        self._heartbeats.set_targets(self._receiver.awaited())
        self._want_progress()
        results = self._receiver.take()
        # How vLLM is told a receive failed: by its blocks with one KV-cache
        # group; with several, block ids are unique per group only and vLLM
        # takes whole requests (failed_recving), recomputing each from its
        # first token.
        if len(self.config.kv_groups) == 1:
            self._load_errors |= results.load_errors
        else:
            self._failed |= results.failed
        return results.finished

    def _read_replies(self, now: float) -> None:
        for address, msg in self._peers.receive():
            if isinstance(msg, Failure):
                self._receiver.failed(msg.transfer_id, msg.cause, msg.rank, now)
            elif isinstance(msg, HelloRequest):
                self._greeted.discard(address)
                self._greet(address)
            elif isinstance(msg, HelloReply):
                self._hello_reply(address, msg)
            elif isinstance(msg, Done):  # a Reconcile's answer: the KV landed
                # It may end the receive before NIXL's own notification is
                # read (NIXL is not read once nothing is awaited).
                self.tracer.mark(msg.transfer_id, "notif_received", via="reconcile")
                self._receiver.done(msg.transfer_id, msg.rank, now, msg.digest)

    def _read_control(self, now: float) -> None:
        """Apply the ``kvpush forget`` files written since the last look."""
        for forget in self._control.poll(now):
            self._forget(forget)

    def _forget(self, forget: Forget) -> None:
        """An operator proved prefill ``forget.engine_id`` gone (its host is
        down): every rank of it, as a closed loopback connection would,
        except a rank that came back (a boot first heard after the forget
        was written)."""

        def came_back(address: Address, boot: str | None) -> bool:
            return (
                boot is not None
                and self._prefill_boots.get(address) == boot
                and self._boot_since.get(address, forget.at) > forget.at
            )

        n = self._receiver.engine_gone(forget.engine_id, came_back)
        logger.warning(
            "kvpush: an operator forgot prefill %s (kvpush forget): %d pending "
            "receive(s) from it fail and their blocks are released",
            forget.engine_id,
            n,
        )
        if n:
            self.counters.add("forgotten", n)

    def take_quarantined(self) -> dict[str, int]:
        """Quarantined blocks by prefill engine, for the gauge: only the
        engines whose count changed since the last call (0: none left)."""
        now = self._receiver.quarantined_by_engine()
        changed = {k: v for k, v in now.items() if self._quarantined.get(k) != v}
        changed.update({k: 0 for k in self._quarantined if k not in now})
        self._quarantined = now
        return changed

    def _verify(self) -> None:
        """Hand the receiver's digest checks to the verifier and give it
        the verdicts reached (a mismatch fails that receive)."""
        checks = self._receiver.take_checks()
        if self._verifier is None:  # unreachable: checks need a Done
            return
        for check in checks:
            self._verifier.submit(check)
        for tid, rank, intact in self._verifier.take():
            self._receiver.checked(tid, rank, intact)

    def _hello_reply(self, address: Address, reply: HelloReply) -> None:
        old = self._prefill_boots.get(address)
        self._prefill_boots[address] = reply.boot_id
        if old != reply.boot_id:
            self._boot_since[address] = time.time()
        if old is not None and old != reply.boot_id:  # the old process is gone
            logger.warning("kvpush: the prefill at %s:%d restarted", *address)
            self.counters.add("peer_lost")
            self._receiver.peer_restarted(address, reply.boot_id)
        if not reply.accepted:
            logger.error(
                "kvpush: prefill %s rank %d refused decode rank %d; its "
                "transfers fall back to local compute: %s",
                reply.engine_id,
                reply.rank,
                self.config.tp_rank,
                reply.reason,
            )
            self._receiver.peer_refused(address)
        elif address in self._to_reconcile:
            self._reconcile(address, self._to_reconcile[address])
        self._to_reconcile.pop(address, None)

    def _reconcile(self, address: Address, lost: set[str]) -> None:
        """The connection to ``address`` came back (off loopback): what
        either side sent on it while it was going down may be lost, so name
        each receive still awaited from it of those (``lost``) that were
        awaited when it went down; prefill answers each it no longer holds
        with its final word (:mod:`kvpush.connector.prefill.reconcile`).

        Not the receives expected since: their Registrations go on decode's
        scheduler socket, which may deliver them after this Reconcile, and
        prefill closes every id it has not heard of, so naming one would
        fail a healthy transfer. (This is what happens when the connection
        dropped while decode was idle: decode reads the news at its next
        step, the one that registers the next request.) A Registration lost
        in the same step the loss is read is settled by decode's deadline."""
        ids = [t for t in self._receiver.awaited_ids(address) if t in lost]
        for start in range(0, len(ids), MAX_IDS_PER_MESSAGE):
            chunk = tuple(ids[start : start + MAX_IDS_PER_MESSAGE])
            ask = Reconcile(self.config.engine_id, self.config.boot_id, chunk)
            sent = self._peers.send(*address, ask)
            self.counters.add("reconcile.sent" if sent else "reconcile.not_sent")

    def _watch_connections(self) -> None:
        """Greet a prefill again on every reconnect. A loopback connection
        that closed proves the prefill process is gone (only its exit closes
        it): fail what we wait on from it. Across a network a closed
        connection proves nothing (a partition looks the same): the receives
        wait, and the HelloReply after the reconnect settles them: a new
        boot id proves the old process gone, and either way decode then
        reconciles (:meth:`_reconcile`)."""
        for event in self._peers.connection_events():
            address = event.address
            if event.up:
                self._connected.add(address)
                self._greet(address)
                continue
            was_connected = address in self._connected
            if was_connected:
                logger.warning("kvpush: lost the prefill at %s:%d", *address)
                self._connected.discard(address)
            self._greeted.discard(address)
            if is_loopback(address[0]):
                # counted once per loss: every failed reconnect while the
                # prefill is down closes a socket too (ZMQ's EVENT_CLOSED)
                if was_connected:
                    self.counters.add("peer_lost")
                self._prefill_boots.pop(address, None)
                self._boot_since.pop(address, None)
                self._receiver.peer_lost(address)
            else:
                # (those of an earlier loss still awaited are among them)
                awaited = self._receiver.awaited_ids(address)
                self._to_reconcile[address] = set(awaited)

    def reserved_blocks(self) -> int:
        """Destination blocks still reserved for transfers."""
        return sum(len(h.block_ids) for h in self._receiver.holds())

    def take_load_errors(self) -> set[int]:
        """Blocks of failed receives (one KV-cache group), since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed(self) -> set[str]:
        """Requests whose receive failed (several KV-cache groups), since
        the last call; each is among those :meth:`get_finished` returned."""
        failed, self._failed = self._failed, set()
        return failed

    def close(self) -> None:
        self._heartbeats.close()
        if self._verifier is not None:
            self._verifier.close()
        stopped = self._progress is None or self._progress.close()
        self._peers.close()
        if self._io is not None and stopped:  # never under a running poll
            self._io.close()
        self.tracer.close()
