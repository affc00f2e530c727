"""Fault injection for tests: a JSON file the connector re-reads while running.

Off unless the launcher was asked for it (``kvpush up --fault-injection``,
which sets ``kv_connector_extra_config.fault_file = RUN_DIR/faults.json``);
a production instance has no fault file and :class:`FaultSource` always
answers "no faults". The file holds one object, every key optional::

    {"drop_registrations": true,   # decode's scheduler sends no Registration
     "delay_ready_s": 2.0,         # prefill's writer holds finished KV this long
     "delay_post_s": 2.0,          # ...and a matched transfer before its WRITE
     "corrupt_received": true}     # decode inverts one received byte

so a test can hold a transfer in one phase (before the match, or matched but
not yet written) or make a deadline pass, on a running cluster, without a
restart. ``corrupt_received`` is the KV digests' self-test: decode inverts
the first byte of the first block it received for a transfer, in its KV
memory, right before it checks that transfer's digest (only transfers
``verify_kv`` selects are checked, so only those are corrupted); the
mismatch must be caught and the request recomputed (or failed, by
``kv_load_failure_policy``). A missing or unreadable file means no faults.

The one seam: production code never branches on faults. The writer asks
:meth:`FaultSource.ready_delay_s` and :meth:`FaultSource.post_delay_s` for
the time a finished KV waits before the matcher sees it and a matched
transfer waits before its WRITE (always 0 without a fault file), and
decode's scheduler sends through :func:`outbound`, which is the side
channel itself unless a fault file was given; decode's digest checker asks
:meth:`FaultSource.corrupts_received` (always False without a fault file).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvpush.transfer.messages import Message, Registration

logger = logging.getLogger(__name__)

RECHECK_S = 0.1  # how often the file's mtime is looked at


@dataclass(frozen=True)
class Faults:
    drop_registrations: bool = False
    delay_ready_s: float = 0.0
    delay_post_s: float = 0.0
    corrupt_received: bool = False

    @classmethod
    def from_dict(cls, d: object) -> Faults:
        if not isinstance(d, dict):
            raise ValueError("the fault file must hold a JSON object")
        unknown = set(d) - {
            "drop_registrations",
            "delay_ready_s",
            "delay_post_s",
            "corrupt_received",
        }
        if unknown:
            raise ValueError(f"unknown fault keys {sorted(unknown)}")
        faults = cls(
            drop_registrations=bool(d.get("drop_registrations", False)),
            delay_ready_s=float(d.get("delay_ready_s", 0.0)),
            delay_post_s=float(d.get("delay_post_s", 0.0)),
            corrupt_received=bool(d.get("corrupt_received", False)),
        )
        if faults.delay_ready_s < 0 or faults.delay_post_s < 0:
            raise ValueError("fault delays must be >= 0")
        return faults


NO_FAULTS = Faults()


class FaultSource:
    """The current :class:`Faults`, re-read when the file changes."""

    def __init__(self, path: str) -> None:
        self._path = Path(path) if path else None
        self._mtime: float | None = None
        self._checked = 0.0
        self._faults = NO_FAULTS

    @property
    def enabled(self) -> bool:
        """Whether a fault file was given at all (tests only)."""
        return self._path is not None

    def drops_registrations(self) -> bool:
        return self.current().drop_registrations

    def ready_delay_s(self) -> float:
        """How long finished KV is held before the matcher sees it."""
        return self.current().delay_ready_s

    def post_delay_s(self) -> float:
        """How long a matched transfer is held before its WRITE."""
        return self.current().delay_post_s

    def corrupts_received(self) -> bool:
        """Whether decode corrupts received KV before checking its digest."""
        return self.current().corrupt_received

    def current(self) -> Faults:
        if self._path is None:
            return NO_FAULTS
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return self._faults
        self._checked = now
        try:
            mtime = self._path.stat().st_mtime
        except OSError:
            self._mtime, self._faults = None, NO_FAULTS
            return NO_FAULTS
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                self._faults = Faults.from_dict(json.loads(self._path.read_text()))
            except (OSError, ValueError) as e:
                logger.warning("kvpush: ignoring fault file %s: %s", self._path, e)
                self._faults = NO_FAULTS
            if self._faults != NO_FAULTS:
                logger.warning("kvpush: FAULT INJECTION active: %s", self._faults)
        return self._faults


class Sender(Protocol):
    def send(self, host: str, port: int, message: Message) -> bool: ...


class _DroppingSender:
    """Sends like ``inner`` but drops Registrations while the fault file
    says ``drop_registrations`` (as if the network lost them)."""

    def __init__(self, inner: Sender, faults: FaultSource) -> None:
        self._inner, self._faults = inner, faults

    def send(self, host: str, port: int, message: Message) -> bool:
        if isinstance(message, Registration) and self._faults.drops_registrations():
            logger.warning(
                "kvpush: FAULT: registration %s dropped", message.transfer_id
            )
            return True  # lost on the way, as far as the sender can tell
        return self._inner.send(host, port, message)


def outbound(inner: Sender, faults: FaultSource) -> Sender:
    """The sender decode's scheduler uses: ``inner`` itself in production."""
    return _DroppingSender(inner, faults) if faults.enabled else inner
