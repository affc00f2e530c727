"""Decode's heartbeat thread: decode is alive, whatever its engine does.

Prefill drops a decode it has not heard from for its peer timeout. A
decode's engine step can last longer than that (a long forward on a loaded
GPU), so heartbeats must not ride on the step: this thread sends one
:class:`~kvpush.transfer.messages.Heartbeat` every ``period_s`` to each
prefill the worker waits on. The worker's main thread only publishes the
set of those prefills (:meth:`Heartbeats.set_targets`, a frozenset swapped
in one assignment); the thread owns its own side-channel sockets.
"""

from __future__ import annotations

import logging
import threading

from kvpush.connector.counters import Counters
from kvpush.connector.side_channel import Peers
from kvpush.transfer.messages import Heartbeat

logger = logging.getLogger(__name__)

Address = tuple[str, int]


class Heartbeats:
    """Thread ``kvpush-heartbeat`` of one decode worker."""

    def __init__(
        self,
        engine_id: str,
        boot_id: str,
        secret: bytes,
        period_s: float,
        counters: Counters,
    ) -> None:
        self._beat = Heartbeat(engine_id=engine_id, boot_id=boot_id)
        self._secret, self._period_s, self._counters = secret, period_s, counters
        self._targets: frozenset[Address] = frozenset()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvpush-heartbeat", daemon=True
        )
        self._thread.start()

    def set_targets(self, addresses: frozenset[Address]) -> None:
        """The prefills to beat to from now on (main thread)."""
        self._targets = addresses

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        peers = Peers(self._secret)  # this thread's own sockets
        try:
            while not self._stop.wait(self._period_s):
                for host, port in self._targets:
                    if not peers.send(host, port, self._beat):
                        self._counters.add("heartbeat.not_sent")
        except Exception:  # a heartbeat thread that dies is a silent decode
            logger.exception("kvpush heartbeat: stopped by an error")
        finally:
            peers.close()
