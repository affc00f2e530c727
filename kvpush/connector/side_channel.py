"""ZMQ plumbing for kvpush's side channel (the only place that touches ZMQ).

* :class:`Listener` — prefill's worker binds a ROUTER socket on its side-channel
  port and runs one thread that receives every message (decoded with
  :func:`kvpush.transfer.messages.decode`; anything malformed is logged,
  counted and dropped, so the thread survives any input) and sends the
  replies queued by other threads. It owns the socket; nothing else uses it.
* :class:`Peers` — DEALER sockets to prefill side channels, one per address,
  created on first use and owned by the single thread that uses them (decode's
  scheduler for registrations, decode's worker for Hello and replies). With
  ``monitor=True`` it also watches each connection (ZMQ socket monitor) and
  reports when one comes up or goes down: a prefill whose process died is
  noticed as soon as its kernel closes the TCP connection.

With a shared secret, every message travels as two frames, an HMAC-SHA256
of the payload and the payload; a message whose MAC does not verify is
rejected like any malformed one (counted as ``rejected.auth``). The MAC
authenticates the sender; it does not hide the content or stop replays.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpush.connector.counters import Counters
from kvpush.transfer.messages import (
    MAX_MESSAGE_BYTES,
    Message,
    ProtocolError,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

# A decode's connection to a side channel is pinged (ZMTP heartbeats) and
# dropped when a pong is this late, so that after a partition it reconnects
# (and decode reconciles) rather than wait out TCP's retransmission back-off
# on a connection that carried data when the link went down. Long enough
# that a short cut (a few seconds) keeps the connection and its transfers.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 6000
POLL_MS = 50  # the listener's wake-up period when idle (not a busy poll)
# (a reply wakes it at once: :meth:`Listener.reply`)
SEND_HWM = 10_000  # messages queued per peer before sends fail
_UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def seal(secret: bytes, data: bytes) -> list[bytes]:
    """The frames that carry ``data``: itself, or its MAC and itself."""
    if not secret:
        return [data]
    return [hmac.new(secret, data, hashlib.sha256).digest(), data]


def unseal(secret: bytes, frames: list[bytes]) -> Message:
    """The message in ``frames`` (sender route already removed), checked
    against ``secret``; :class:`ProtocolError` when it is not acceptable."""
    if not secret:
        if len(frames) != 1:
            raise ProtocolError(f"expected 1 frame, got {len(frames)}")
        return decode(frames[0])
    if len(frames) != 2:
        raise ProtocolError(
            f"expected a MAC and a payload, got {len(frames)} frames", "auth"
        )
    mac = hmac.new(secret, frames[1], hashlib.sha256).digest()
    if not hmac.compare_digest(mac, frames[0]):
        raise ProtocolError("message authentication failed", "auth")
    return decode(frames[1])


class Listener:
    """Receive side-channel messages on ``host:port`` in a named thread.

    ``on_message(route, message)`` is called in the listener thread for each
    valid message; ``route`` names the sender's socket for :meth:`reply`.
    A reply from another thread wakes the listener through a socket pair,
    so it leaves at once rather than at the next poll period.
    """

    def __init__(
        self,
        host: str,
        port: int,
        on_message: Callable[[bytes, Message], None],
        counters: Counters | None = None,
        secret: bytes = b"",
    ) -> None:
        self._counters = counters
        self._secret = secret
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Larger messages are cut off by ZMQ before they reach memory;
        # anything over MAX_MESSAGE_BYTES is still counted and dropped.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_MESSAGE_BYTES)
        self._sock.bind(f"tcp://{host}:{port}")
        self._on_message = on_message
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self.num_rejected = 0
        self._thread = threading.Thread(
            target=self._run, name="kvpush-listener", daemon=True
        )
        self._thread.start()

    def reply(self, route: bytes, message: Message) -> None:
        """Queue ``message`` to the socket ``route`` (any thread)."""
        self._outbox.put((route, encode(message)))  # sealed in the thread
        self._wake()

    def _wake(self) -> None:
        # BlockingIOError: a wake-up is pending; OSError: the listener closed
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(POLL_MS))
            if self._sock in ready:
                self._receive_all()
            if self._wake_r.fileno() in ready:
                self._drain_wakes()
            self._send_all()
        self._sock.close(linger=0)
        self._wake_r.close()
        self._wake_w.close()

    def _drain_wakes(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                self._reject(ProtocolError(f"{len(frames)} frame(s), no payload"))
                continue
            try:
                message = unseal(self._secret, frames[1:])
            except ProtocolError as e:
                self._reject(e)
                continue
            try:
                self._on_message(frames[0], message)
            except Exception:  # the listener must outlive any handler bug
                logger.exception("kvpush side channel: handler failed")

    def _send_all(self) -> None:
        while True:
            try:
                route, data = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._sock.send_multipart(
                    [route, *seal(self._secret, data)], zmq.NOBLOCK
                )
            except zmq.ZMQError as e:
                logger.warning("kvpush side channel: reply dropped: %s", e)

    def _reject(self, error: ProtocolError) -> None:
        self.num_rejected += 1
        if self._counters is not None:
            self._counters.add(f"rejected.{error.kind}")
        logger.warning("kvpush side channel: dropped a message: %s", error.reason)

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout_s)


@dataclass(frozen=True)
class ConnectionEvent:
    """The connection to the side channel at ``address`` came up or went down."""

    address: tuple[str, int]
    up: bool


class Peers:
    """DEALER sockets to side channels, keyed by ``(host, port)``.

    Not thread-safe: one owner thread. Sends never block; a full queue or a
    closed context drops the message with a warning (the peer's deadlines
    cover the loss)."""

    def __init__(self, secret: bytes = b"", monitor: bool = False) -> None:
        self._secret = secret
        self._monitor = monitor
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks: dict[tuple[str, int], zmq.Socket[bytes]] = {}
        self._monitors: dict[tuple[str, int], zmq.Socket[bytes]] = {}

    def send(self, host: str, port: int, message: Message) -> bool:
        """Queue ``message`` for the side channel at ``host:port``."""
        sock = self._socks.get((host, port))
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            if self._monitor:
                events = _UP_EVENTS | _DOWN_EVENTS
                self._monitors[(host, port)] = sock.get_monitor_socket(events)
            sock.connect(f"tcp://{host}:{port}")
            self._socks[(host, port)] = sock
        try:
            sock.send_multipart(seal(self._secret, encode(message)), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("kvpush: message to %s:%d dropped: %s", host, port, e)
            return False
        return True

    def receive(self) -> list[tuple[tuple[str, int], Message]]:
        """Every message waiting on any socket (replies from prefills), with
        the address it came from; malformed ones are logged and dropped."""
        out: list[tuple[tuple[str, int], Message]] = []
        for address, sock in self._socks.items():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    out.append((address, unseal(self._secret, frames)))
                except ProtocolError as e:
                    logger.warning("kvpush: dropped a reply: %s", e.reason)
        return out

    def connection_events(self) -> list[ConnectionEvent]:
        """Connections that came up or went down since the last call, in
        order (only with ``monitor=True``)."""
        out: list[ConnectionEvent] = []
        for address, mon in self._monitors.items():
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] & _UP_EVENTS:
                    out.append(ConnectionEvent(address, True))
                elif event["event"] & _DOWN_EVENTS:
                    out.append(ConnectionEvent(address, False))
        return out

    def close(self) -> None:
        for address, sock in self._socks.items():
            if address in self._monitors:
                sock.disable_monitor()
                self._monitors[address].close(linger=0)
            sock.close(linger=0)
        self._socks.clear()
        self._monitors.clear()
