"""Decode's NIXL progress thread: notifications are read whatever the
engine step is doing.

NIXL's own progress thread is off (:class:`~kvpush.connector.nixl_io.NixlIO`),
so on the receiving side it is the calls to read notifications that drive
UCX: off one host, both connection set-up and the TCP data of a WRITE move
only while the target calls ``get_new_notifs`` (measured: polling every
200 ms made a 64 MB WRITE take about 1 s). Reading them only in
``get_finished``, once per engine step, tied transfer speed to decode's
step time. This thread reads them every :data:`POLL_S` instead and hands
the payloads to the worker's main thread through a queue; the main thread
takes them in ``get_finished`` (:meth:`Progress.take`) and alone decides
what they mean (the thread never touches the Receiver).

NIXL thread-safety: the agent is made without a listener thread, so its
sync mode is NIXL's "none" (no locking inside). Once :class:`Progress` has
started, this thread is the only caller of the agent's notification API,
and the main thread calls nothing on the agent but reads the plain
attributes set at construction (``name``, ``metadata``, ``layout``); it
closes the agent only after :meth:`Progress.close` saw this thread stop.
Decode posts no WRITEs, so nothing else on decode calls NIXL.

Polling only while a receive is awaited: the worker's main thread says
at each ``bind`` and ``get_finished`` whether any receive is pending
(:meth:`Progress.want`); with none, the thread blocks on an event and
reads nothing (it wakes every :data:`IDLE_WAKE_S` only to see whether it
should stop). Nothing is lost while it sleeps: a notification waits in
NIXL until the next read, and a WRITE to this decode is posted only after
decode registered its blocks, which its worker learns in the same step's
``bind``, before the forward. Polling all the time would take the GIL a
thousand times a second from the model runner for nothing; on the dev
machine that cost stays below the noise of a stand-in engine step
(``kvpush bench-micro``, "Decode step with the NIXL progress thread"),
but an idle decode should not pay it at all.

Cost and limits while polling: about 3 % of a core on the 2-core dev
machine (~900 reads a second; one read takes under 1 us). The thread needs
the GIL for each read: while the main thread runs Python code it gets it
within the interpreter's switch interval (5 ms), and a NIXL call that keeps
the GIL (none on decode's main thread) would hold it back.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol

from kvpush.connector.counters import Counters

logger = logging.getLogger(__name__)

POLL_S = 0.001  # between two reads of the notifications (1 kHz)
JOIN_S = 2.0  # close(): how long to wait for the thread
IDLE_WAKE_S = 1.0  # with no receive awaited: how often the thread wakes


class NotificationSource(Protocol):
    """What this thread needs of :class:`~kvpush.connector.nixl_io.NixlIO`."""

    def notifications(self) -> list[bytes]: ...


class Progress:
    """Thread ``kvpush-nixl-progress`` of one decode worker."""

    def __init__(
        self,
        io: NotificationSource,
        counters: Counters,
        poll_s: float = POLL_S,
        idle_wake_s: float = IDLE_WAKE_S,
    ) -> None:
        self._io, self._counters, self._poll_s = io, counters, poll_s
        self._idle_wake_s = idle_wake_s
        self._queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._wanted = threading.Event()  # set: a receive is awaited
        self.num_polls = 0  # written by the thread only (tests read it)
        self.num_idle_wakes = 0  # woke with nothing awaited (no read)
        self.num_notifications = 0
        self._thread = threading.Thread(
            target=self._run, name="kvpush-nixl-progress", daemon=True
        )
        self._thread.start()

    def take(self) -> list[bytes]:
        """Every notification payload read since the last call, in order
        (main thread)."""
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def want(self, awaited: bool) -> None:
        """Whether a receive is awaited (main thread): poll NIXL while one
        is, sleep while none is."""
        if awaited:
            self._wanted.set()
        else:
            self._wanted.clear()

    @property
    def polling(self) -> bool:
        """Whether the thread reads NIXL now (a receive is awaited)."""
        return self._wanted.is_set()

    def close(self, timeout_s: float = JOIN_S) -> bool:
        """Stop the thread; True once it ended (only then may the agent be
        closed)."""
        self._stop.set()
        self._wanted.set()  # wake it if it sleeps
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error(
                "kvpush: NIXL progress thread did not stop in %.0f s", timeout_s
            )
            return False
        return True

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            if not self._wanted.wait(self._idle_wake_s):
                self.num_idle_wakes += 1  # nothing awaited: no read
                continue
            if self._stop.wait(self._poll_s):
                return
            try:
                payloads = self._io.notifications()
            except Exception:  # NIXL raised: keep polling, say so once
                if not failing:
                    logger.exception("kvpush: reading NIXL notifications failed")
                self._counters.add("notif.poll_failed")
                failing = True
                continue
            failing = False
            self.num_polls += 1
            for payload in payloads:
                self._queue.put(payload)
            self.num_notifications += len(payloads)
