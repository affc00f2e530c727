"""ZMQ plumbing for kvpush's side channel (the only place that touches ZMQ).

* :class:`Listener` — prefill's worker binds a ROUTER socket on its side-channel
  port and runs one thread that receives every message (decoded with
  :func:`kvpush.transfer.messages.decode`; anything malformed is logged,
  counted and dropped, so the thread survives any input) and sends the
  replies queued by other threads. It owns the socket; nothing else uses it.
* :class:`Peers` — DEALER sockets to prefill side channels, one per address,
  created on first use and owned by the single thread that uses them (decode's
  scheduler for registrations, decode's worker for Hello and replies).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import zmq

from kvpush.transfer.messages import Message, ProtocolError, decode, encode

logger = logging.getLogger(__name__)

POLL_MS = 50  # the listener's wake-up period when idle (not a busy poll)
SEND_HWM = 10_000  # messages queued per peer before sends fail


class Listener:
    """Receive side-channel messages on ``host:port`` in a named thread.

    ``on_message(route, message)`` is called in the listener thread for each
    valid message; ``route`` names the sender's socket for :meth:`reply`.
    """

    def __init__(
        self, host: str, port: int, on_message: Callable[[bytes, Message], None]
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.bind(f"tcp://{host}:{port}")
        self._on_message = on_message
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.num_rejected = 0
        self._thread = threading.Thread(
            target=self._run, name="kvpush-listener", daemon=True
        )
        self._thread.start()

    def reply(self, route: bytes, message: Message) -> None:
        """Queue ``message`` to the socket ``route`` (any thread)."""
        self._outbox.put((route, encode(message)))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(POLL_MS):
                self._receive_all()
            self._send_all()
        self._sock.close(linger=0)

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._reject(f"expected 2 frames, got {len(frames)}")
                continue
            try:
                message = decode(frames[1])
            except ProtocolError as e:
                self._reject(e.reason)
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
                self._sock.send_multipart([route, data], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("kvpush side channel: reply dropped: %s", e)

    def _reject(self, reason: str) -> None:
        self.num_rejected += 1
        logger.warning("kvpush side channel: dropped a message: %s", reason)

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


class Peers:
    """DEALER sockets to side channels, keyed by ``(host, port)``.

    Not thread-safe: one owner thread. Sends never block; a full queue or a
    closed context drops the message with a warning (the peer's deadlines
    cover the loss)."""

    def __init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socks: dict[tuple[str, int], zmq.Socket[bytes]] = {}

    def is_known(self, host: str, port: int) -> bool:
        return (host, port) in self._socks

    def send(self, host: str, port: int, message: Message) -> bool:
        """Queue ``message`` for the side channel at ``host:port``."""
        sock = self._socks.get((host, port))
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.connect(f"tcp://{host}:{port}")
            self._socks[(host, port)] = sock
        try:
            sock.send(encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("kvpush: message to %s:%d dropped: %s", host, port, e)
            return False
        return True

    def receive(self) -> list[Message]:
        """Every message waiting on any socket (replies from prefills);
        malformed ones are logged and dropped."""
        out: list[Message] = []
        for sock in self._socks.values():
            while True:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    out.append(decode(data))
                except ProtocolError as e:
                    logger.warning("kvpush: dropped a reply: %s", e.reason)
        return out

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
