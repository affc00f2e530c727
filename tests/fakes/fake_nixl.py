"""Fake transports for the connector's unit tests, shared by every test file.

:class:`FakeNixlIO` stands in for :class:`kvpush.connector.nixl_io.NixlIO`
(same public surface: ``name``, ``layout``, ``mem_type``, ``metadata``,
``load_peer``, ``write``, ``state``, ``release``, ``notifications``,
``close``). It records every WRITE (:class:`WriteRecord`) and can be
scripted:

* :meth:`FakeNixlIO.script_polls` — what ``state`` returns for the next
  writes, e.g. ``("PROC", "PROC", "DONE")`` or ``("ERR",)``; the default
  is ``("DONE",)``;
* :meth:`FakeNixlIO.fail_next_write` — the next ``write`` raises before
  any handle exists (``get_xfer_descs`` or ``initialize_xfer`` raised);
* :meth:`FakeNixlIO.refuse_next_write` — the next ``write`` gets a handle
  but ``transfer`` says ``ERR`` or raises: it raises
  :class:`~kvpush.connector.nixl_io.WriteRefused` carrying that handle
  (recorded, ``WriteRecord.refused``), which the caller must release;
* ``WriteRecord.running_at_post`` — how many earlier WRITEs still ran when
  one was posted (0 for a Done that waited for every earlier one);
* ``cancellable = False`` — a running WRITE cannot be cancelled;
  ``release_failures = n`` — the next ``n`` releases fail;
  :meth:`FakeNixlIO.raise_next` — the next ``state`` or ``release`` call
  (or the next ``times`` of them) raises;
* :meth:`FakeNixlIO.deliver` — a notification arrives;
* :meth:`FakeNixlIO.link` — two fakes act as a pair: a WRITE posted on one
  delivers its notification (if not empty) to the other when the write
  completes (``state`` returns ``DONE``), as NIXL does.

Misuse that real NIXL would punish (polling a released handle, writing to a
peer never loaded, using a closed agent) is recorded in ``misuse`` rather
than raised, because the writer thread swallows exceptions; tests assert it
stays empty.

:class:`FakePeers` stands in for :class:`kvpush.connector.side_channel.Peers`
(``send``, ``receive``, ``connection_events``, ``close``): it records what
is sent and hands out replies queued with :meth:`FakePeers.queue_reply`.

Both are thread-safe: the writer thread uses the fake while a test reads it.
:func:`wait_for` is the bounded wait for what another thread does with them;
:func:`leftovers` lists the state an owner still holds, for lifecycle tests.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpush.connector.nixl_io import WriteRefused, XferState
from kvpush.connector.side_channel import ConnectionEvent
from kvpush.transfer.coalesce import Desc, Descs, desc_list
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.messages import Message, decode

T = TypeVar("T")

_METADATA_PREFIX = b"fake-nixl-agent:"
_STATES = ("PROC", "DONE", "ERR")


@dataclass
class WriteRecord:
    """One posted WRITE, as the fake saw it (descriptors as :class:`Desc` lists)."""

    src: list[Desc]
    dst: list[Desc]
    peer: str
    notif: bytes
    states: deque[str] = field(repr=False)
    num_polls: int = 0
    done: bool = False
    last: str = ""  # the state last returned
    released: bool = False
    cancelled: bool = False
    refused: bool = False  # NIXL refused it at post (WriteRefused)
    running_at_post: int = 0  # this agent's WRITEs not yet DONE/ERR when posted

    @property
    def message(self) -> Message:
        """The notification decoded (a :class:`~kvpush.transfer.messages.Done`)."""
        return decode(self.notif)


class FakeMemory:
    """The bytes behind a fake agent's layout, for tests that check what
    its WRITEs copy (the fake itself moves none): :meth:`copy` applies a
    WRITE's descriptors from one memory to another."""

    def __init__(self, layout: KvLayout) -> None:
        self.base = min(layout.base_addrs)
        top = max(layout.base_addrs) + layout.num_blocks * layout.block_bytes
        self.data = bytearray(top - self.base)

    def at(self, addr: int, length: int) -> bytes:
        return bytes(self.data[addr - self.base : addr - self.base + length])

    def put(self, addr: int, payload: bytes) -> None:
        self.data[addr - self.base : addr - self.base + len(payload)] = payload

    def read(self, addr: int, length: int) -> memoryview:
        """A view (the :class:`~kvpush.connector.kv_bytes.KvBytes` surface
        KV digests read through)."""
        return memoryview(self.data)[addr - self.base : addr - self.base + length]

    def flip(self, addr: int) -> None:
        """Invert one byte (what fault injection does to received KV)."""
        self.data[addr - self.base] ^= 0xFF

    def copy(self, write: WriteRecord, dst: FakeMemory) -> None:
        """Apply ``write`` (posted by this memory's agent) into ``dst``."""
        for s, d in zip(write.src, write.dst, strict=True):
            assert s.length == d.length, (s, d)
            dst.put(d.addr, self.at(s.addr, s.length))


class FakeNixlIO:
    """A NIXL agent that moves no bytes; see the module docstring."""

    def __init__(self, name: str, layout: KvLayout, mem_type: str = "DRAM") -> None:
        self.name = name
        self.layout = layout
        self.mem_type = mem_type
        self.metadata: bytes = _METADATA_PREFIX + name.encode()
        self.writes: list[WriteRecord] = []
        self.loaded_peers: list[str] = []
        self.misuse: list[str] = []
        self.closed = False
        self.cancellable = True  # False: NIXL cannot cancel a WRITE in flight
        self.release_failures = 0  # how many next releases fail (ERR kept)
        self._raise_on: dict[str, int] = {}  # call -> how many next raise
        self._lock = threading.Lock()
        self._poll_script: tuple[str, ...] = ("DONE",)
        self._write_errors: deque[Exception] = deque()
        self._refusals: deque[Exception | None] = deque()
        self._notifs: list[bytes] = []
        self._linked: dict[str, FakeNixlIO] = {}

    # -- scripting (test thread) ---------------------------------------------

    def script_polls(self, *states: str) -> None:
        """``poll`` on each later write returns ``states`` in order; the last
        one must be ``"DONE"`` or ``"ERR"`` (the handle is released then)."""
        if not states or states[-1] == "PROC" or set(states) - set(_STATES):
            raise ValueError(f"a poll script ends in DONE or ERR, got {states}")
        with self._lock:
            self._poll_script = tuple(states)

    def fail_next_write(self, error: Exception | None = None) -> None:
        """The next ``write`` raises ``error`` (a RuntimeError by default)."""
        with self._lock:
            self._write_errors.append(error or RuntimeError("fake NIXL refused"))

    def refuse_next_write(self, error: Exception | None = None) -> None:
        """The next ``write`` gets a handle, then ``transfer`` says ``ERR``
        (``error`` None) or raises ``error``: ``write`` raises
        :class:`~kvpush.connector.nixl_io.WriteRefused` with that handle."""
        with self._lock:
            self._refusals.append(error)

    def deliver(self, payload: bytes) -> None:
        """A notification arrives for this agent (any thread)."""
        with self._lock:
            self._notifs.append(payload)

    def link(self, other: FakeNixlIO) -> None:
        """Pair two fakes: each may load the other and write into it."""
        self._linked[other.name] = other
        other._linked[self.name] = self

    def writes_snapshot(self) -> list[WriteRecord]:
        with self._lock:
            return list(self.writes)

    # -- the NixlIO surface --------------------------------------------------

    def load_peer(self, agent_name: str, metadata: bytes) -> str:
        if not metadata.startswith(_METADATA_PREFIX):
            raise ValueError("not fake NIXL agent metadata")
        name = metadata.removeprefix(_METADATA_PREFIX).decode()
        with self._lock:
            self.loaded_peers.append(name)
        return name

    def write(self, src: Descs, dst: Descs, peer: str, notif: bytes) -> Any:
        with self._lock:
            self._check_open("write")
            if peer not in self.loaded_peers:
                self.misuse.append(f"write to {peer!r}, which was never loaded")
            if len(src) != len(dst):
                self.misuse.append(f"{len(src)} src but {len(dst)} dst descriptors")
            if self._write_errors:
                raise self._write_errors.popleft()
            record = WriteRecord(
                desc_list(src), desc_list(dst), peer, notif, deque(self._poll_script)
            )
            record.running_at_post = sum(
                w.last not in ("DONE", "ERR") and not w.released for w in self.writes
            )
            self.writes.append(record)
            if self._refusals:
                error = self._refusals.popleft()
                record.refused, record.last = True, "ERR"
                why = "transfer said ERR" if error is None else f"{error}"
                raise WriteRefused(record, f"fake NIXL refused the WRITE: {why}")
            return record

    def state(self, handle: Any) -> XferState:
        with self._lock:
            self._check_open("state")
            if self._raises("state"):
                raise RuntimeError("fake NIXL: check_xfer_state raised")
            record: WriteRecord = handle
            if record.released:
                self.misuse.append("state of a released handle")
                return XferState.ERR
            record.num_polls += 1
            was_done = record.done
            state = (
                record.states.popleft() if len(record.states) > 1 else record.states[0]
            )
            record.done, record.last = state == "DONE", state
            peer = self._linked.get(record.peer)
        if record.done and not was_done and peer is not None and record.notif:
            peer.deliver(record.notif)
        return XferState(state)

    def release(self, handle: Any) -> bool:
        """Release (or, for a running WRITE, cancel): False when a release
        failure is scripted, or the WRITE runs and ``cancellable`` is off."""
        with self._lock:
            if self._raises("release"):
                raise RuntimeError("fake NIXL: release_xfer_handle raised")
            record: WriteRecord = handle
            if record.released:
                self.misuse.append("release of a released handle")
                return False
            if self.release_failures > 0:
                self.release_failures -= 1
                return False
            running = record.last in ("", "PROC")
            if running and not self.cancellable:
                return False
            record.released = True
            record.cancelled = running
            return True

    def raise_next(self, call: str, times: int = 1) -> None:
        """The next ``times`` ``state`` or ``release`` calls raise (as NIXL can)."""
        with self._lock:
            self._raise_on[call] = times

    def _raises(self, call: str) -> bool:
        """Whether this ``call`` raises (under the lock)."""
        left = self._raise_on.get(call, 0)
        if left <= 1:
            self._raise_on.pop(call, None)
        else:
            self._raise_on[call] = left - 1
        return left > 0

    def notifications(self) -> list[bytes]:
        with self._lock:
            self._check_open("notifications")
            out, self._notifs = self._notifs, []
            return out

    def close(self) -> None:
        self.closed = True

    def _check_open(self, what: str) -> None:
        if self.closed:
            self.misuse.append(f"{what} after close")


class FakePeers:
    """Records side-channel sends instead of opening sockets."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, Message]] = []
        self._replies: list[tuple[tuple[str, int], Message]] = []
        self.send_ok = True  # False: every send fails (a full queue)
        self._events: list[ConnectionEvent] = []
        self.closed = False

    def send(self, host: str, port: int, message: Message) -> bool:
        if not self.send_ok:
            return False
        self.sent.append((host, port, message))
        return True

    def receive(self) -> list[tuple[tuple[str, int], Message]]:
        out, self._replies = self._replies, []
        return out

    def connection_events(self) -> list[ConnectionEvent]:
        out, self._events = self._events, []
        return out

    def connection(self, address: tuple[str, int], up: bool) -> None:
        """The connection to ``address`` comes up or goes down (seen at the
        next ``connection_events``)."""
        self._events.append(ConnectionEvent(address, up))

    def queue_reply(
        self, message: Message, address: tuple[str, int] = ("127.0.0.1", 5600)
    ) -> None:
        """``message`` comes back from the prefill at ``address`` at the next
        ``receive``."""
        self._replies.append((address, message))

    def messages(self, kind: type | Iterable[type] = object) -> list[Any]:
        """The messages sent so far, optionally only those of ``kind``."""
        kinds = tuple(kind) if isinstance(kind, Iterable) else (kind,)
        return [m for _, _, m in self.sent if isinstance(m, kinds)]

    def close(self) -> None:
        self.closed = True


def wait_for(
    predicate: Callable[[], T], timeout_s: float = 2.0, step_s: float = 0.002
) -> T:
    """Poll ``predicate`` every ``step_s`` until its answer is true or
    ``timeout_s`` passes; its last answer (any thread, any test)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = predicate()
        if answer or time.monotonic() >= deadline:
            return answer
        time.sleep(step_s)


def leftovers(owner: object, ignore: Iterable[str] = ()) -> dict[str, int]:
    """The non-empty containers (dict, set, list, deque) among ``owner``'s
    attributes, with their sizes: what a lifecycle test expects to be ``{}``
    once every request it started has ended. Names nothing in particular, so
    it keeps working as the owner's fields change."""
    kinds = (dict, set, list, deque)
    skip = set(ignore)
    return {
        name: len(value)
        for name, value in vars(owner).items()
        if isinstance(value, kinds) and value and name not in skip
    }
