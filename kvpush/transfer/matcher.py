"""Pair decode's registrations with prefill's finished KV, in either order.

One :class:`Matcher` lives on each prefill worker and is owned by the one
thread that handles side-channel messages and prefill triggers (the adapter
feeds it through a queue). It is pure: every call takes ``now`` from the
caller's clock and returns a typed result; nothing raises for bad peer input.

Who calls what:

* :meth:`Matcher.add_registration` when a :class:`Registration` arrives;
* :meth:`Matcher.add_ready` when prefill has computed a prompt whose leg is a
  :class:`PrefillLeg` (the trigger: transfer id, source block ids, tokens);
* :meth:`Matcher.refresh_ready` on each later chunk of a streamed prompt
  whose first chunk is still pending here, so its ready deadline counts
  from the last chunk;
* :meth:`Matcher.cancel` on a :class:`Cancel` from decode, or when prefill
  aborts the request itself;
* :meth:`Matcher.expire` periodically (see :meth:`Matcher.next_deadline`).

Cost per call, for a writer thread that asks on every wake: ``next_deadline``
and ``engines_with_registrations`` are O(1) amortised (the latter O(number of
decode engines)), ``expire`` is O(k log n) for the k entries and tombstones
due; nothing scans the n entries still waiting (see
:mod:`kvpush.transfer.deadlines`).

Ownership: while an entry is pending, the matcher holds it and its deadline
(prefill's source blocks stay allocated; decode's destination blocks stay
reserved on decode). A :class:`Matched` hands both to the writer, which then
owns the transfer; a :class:`Dropped` hands them back to the caller to free
(the source blocks of its ``ready``, if set) and to tell decode
(``notify_engine_id``, with a :class:`Failure`). A :class:`Rejected`
means the matcher took nothing from this call: the caller still owns what
it passed in.

Who may claim a ready KV (the one place this rule is enforced): a ready KV
bound *early* (its :class:`~kvpush.transfer.messages.PrefillLeg` named
``decode_engine_id``) matches only a registration from that decode engine
carrying no claim token; a ready KV bound *late* (the leg named no decode,
only ``claim_sha256``) matches a registration from any decode engine whose
``claim_token`` hashes (SHA-256, hex, compared with
:func:`hmac.compare_digest`) to that digest. Anything else is a
``mismatch``: the transfer is closed, and both halves go back to the caller
(decode is told). A transfer is claimed once: the matcher remembers which
engine matched it (its tombstone), and a later registration from that
engine is a ``duplicate`` (the transfer goes on; do not tell decode), one
from any other engine is ``claimed`` (that decode must be told: nothing
will be written for it). The same holds while a registration is pending.

Claims prefill drew itself (:func:`is_prefill_claim`: they start with
:data:`PREFILL_CLAIM_PREFIX`, which no router-set claim may) reach a decode
only after this matcher took their ready KV (why:
:mod:`kvpush.connector.vllm_params`). So a registration bearing one, under
a transfer id with no ready KV pending and no tombstone, names KV this
prefill does not hold (a forged claim, another prefill's, or one whose
transfer ended longer ago than the tombstone time): it is refused at once
(``unknown_claim``) and leaves nothing behind, not even a tombstone. A
registration bearing any other claim, or none, may come before its KV (a
router that sends both legs at once) and waits for it.

Prefix cache: decode registers only blocks ``first_block`` onwards of the
prompt's ``n = ceil(num_tokens / block_size)`` blocks. The match pairs, in
every KV-cache group (:mod:`kvpush.transfer.groups`), source blocks
``first_block..n-1`` with ``registration.dst_block_ids`` one to one; blocks
``0..first_block-1`` are not sent. Prefill may hold more than ``n`` source
blocks (extra trailing blocks are ignored) but not fewer.
"""

from __future__ import annotations

import hmac
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from kvpush.transfer import groups
from kvpush.transfer.deadlines import Deadlines
from kvpush.transfer.groups import GroupBlocks
from kvpush.transfer.messages import Registration, claim_digest

Side = Literal["registration", "ready"]
RejectCode = Literal[
    "duplicate", "claimed", "closed", "mismatch", "invalid", "capacity", "unknown_claim"
]
_Tomb = Literal["matched", "closed"]

# The start of every claim prefill draws itself; reserved: no router-set
# claim may start with it (ClaimToken characters; a uuid never does).
PREFILL_CLAIM_PREFIX = "kvpush-claim-"
_NOT_HELD = (
    "no KV here for this prefill-drawn claim: this prefill did not draw it "
    "(forged, or another prefill's), or its transfer ended long ago"
)


def is_prefill_claim(token: str | None) -> bool:
    """``token`` has the form of a claim a prefill draws itself."""
    return token is not None and token.startswith(PREFILL_CLAIM_PREFIX)


@dataclass(frozen=True)
class ReadyKv:
    """Prefill's trigger: the prompt's KV for ``transfer_id`` is computed in
    ``src_block_ids``, one list per KV-cache group (block ``first_block +
    i`` of the prompt in ``src_block_ids[g][i]``); ``decode_engine_id``
    comes from the request's :class:`PrefillLeg`. A whole push is one item
    with the defaults (``first_block`` 0, ``final``). A streamed push sends
    one per prefill chunk, in prompt order, each naming the blocks that
    chunk completed; only the last is ``final``. The matcher holds only a
    stream's first chunk (``first_block`` 0): it opens the transfer; each
    later chunk only pushes its deadline back (:meth:`Matcher.refresh_ready`)."""

    transfer_id: str
    src_block_ids: GroupBlocks
    num_tokens: int
    decode_engine_id: str | None
    first_block: int = 0
    final: bool = True
    claim_sha256: str | None = None

    @property
    def is_late(self) -> bool:
        """Bound late: no decode named; claimed by a registration's token."""
        return self.decode_engine_id is None


@dataclass(frozen=True)
class MatcherConfig:
    """``block_size`` in tokens (both sides must agree: the Hello checks it).
    ``ready_ttl_s``: how long finished KV waits for its registration (a
    streamed prompt's, from its last chunk).
    ``post_margin_s``: a registration's deadline is its arrival plus its
    ``ttl_s`` minus this margin, covering transit and the WRITE itself, so
    prefill never writes into blocks decode has already freed.
    ``tombstone_ttl_s``: how long a finished transfer id is remembered, to
    reject late or repeated messages. ``max_pending``: cap on entries."""

    block_size: int
    ready_ttl_s: float = 30.0
    post_margin_s: float = 1.0
    tombstone_ttl_s: float = 120.0
    max_pending: int = 4096

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {self.block_size}")
        if self.ready_ttl_s <= 0 or self.tombstone_ttl_s <= 0:
            raise ValueError("ready_ttl_s and tombstone_ttl_s must be > 0 seconds")
        if self.post_margin_s < 0:
            raise ValueError(f"post_margin_s must be >= 0, got {self.post_margin_s}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")


@dataclass(frozen=True)
class Matched:
    """Both halves are here: copy ``src_block_ids[g][i]`` to
    ``dst_block_ids[g][i]`` (per KV-cache group; the source ids the first
    chunk knew, from decode's ``first_block``) and post nothing after
    ``post_deadline``. The writer now owns it."""

    transfer_id: str
    registration: Registration
    ready: ReadyKv
    src_block_ids: GroupBlocks
    dst_block_ids: GroupBlocks
    post_deadline: float


@dataclass(frozen=True)
class Pending:
    """Held until the other half arrives or ``deadline`` passes."""

    transfer_id: str
    side: Side
    deadline: float


@dataclass(frozen=True)
class Dropped:
    """A pending entry that the matcher let go (expired, cancelled, or closed
    by a mismatch). Exactly one of ``registration`` and ``ready`` is set."""

    transfer_id: str
    side: Side
    reason: str
    registration: Registration | None = None
    ready: ReadyKv | None = None

    @property
    def notify_engine_id(self) -> str:
        """The decode engine to send a :class:`Failure` to (``""``: nobody,
        a late-bound ready KV that no decode claimed)."""
        if self.registration is not None:
            return self.registration.decode_engine_id
        return (self.ready.decode_engine_id or "") if self.ready else ""


@dataclass(frozen=True)
class Rejected:
    """The call changed nothing it was given. ``code`` ``"duplicate"`` means
    the transfer goes on without this message (do not tell decode);
    ``"claimed"``: it goes on for another decode engine (tell this one, and
    only this one: its registration will never be written); any other code
    means the transfer cannot complete, so tell decode with a
    :class:`Failure`. ``dropped`` lists entries this rejection closed."""

    transfer_id: str
    code: RejectCode
    reason: str
    dropped: tuple[Dropped, ...] = ()


AddResult = Matched | Pending | Rejected


@dataclass(frozen=True)
class _Held:
    deadline: float
    registration: Registration | None = None
    ready: ReadyKv | None = None


class Matcher:
    """Pending registrations and ready KV, keyed by transfer id."""

    def __init__(self, config: MatcherConfig) -> None:
        self.config = config
        self._registrations: dict[str, _Held] = {}
        self._ready: dict[str, _Held] = {}
        self._due: Deadlines[tuple[Side, str]] = Deadlines()
        self._reg_engines: Counter[str] = Counter()  # pending registrations
        self._tombs: dict[str, _Tomb] = {}
        self._claimed_by: dict[str, str] = {}  # matched tid -> decode engine
        self._tombs_due: Deadlines[str] = Deadlines()

    def __len__(self) -> int:
        """Number of pending entries (both sides)."""
        return len(self._registrations) + len(self._ready)

    def add_registration(self, reg: Registration, now: float) -> AddResult:
        """Decode's half arrived. ``reg`` was already decoded and validated."""
        tid = reg.transfer_id
        problem = self._self_problem(reg.num_tokens, reg.first_block, reg.num_blocks)
        if reg.ttl_s <= self.config.post_margin_s:
            problem = problem or (
                f"ttl_s {reg.ttl_s} does not exceed post_margin_s "
                f"{self.config.post_margin_s}"
            )
        held = _Held(now + reg.ttl_s - self.config.post_margin_s, registration=reg)
        return self._add(tid, "registration", held, problem, now)

    def add_ready(self, ready: ReadyKv, now: float) -> AddResult:
        """Prefill's half is computed (or, not ``final``, its stream opened:
        its first chunk). Source ids must be distinct."""
        n = self._num_blocks(ready.num_tokens)
        problem = None
        if (ready.decode_engine_id is None) == (ready.claim_sha256 is None):
            problem = "a ready KV names exactly one of a decode and a claim digest"
        elif ready.num_tokens < 1:
            problem = f"num_tokens must be >= 1, got {ready.num_tokens}"
        elif ready.first_block != 0:
            problem = f"a transfer opens at block 0, not {ready.first_block}"
        elif not ready.src_block_ids:
            problem = "a ready KV names no KV-cache group"
        elif ready.final and min(len(g) for g in ready.src_block_ids) < n:
            problem = (
                f"{ready.num_tokens} tokens need {n} blocks in every group, "
                f"prefill holds {[len(g) for g in ready.src_block_ids]}"
            )
        elif groups.distinct_problem(ready.src_block_ids) is not None:
            problem = "source block ids repeat"
        held = _Held(now + self.config.ready_ttl_s, ready=ready)
        return self._add(ready.transfer_id, "ready", held, problem, now)

    def refresh_ready(self, transfer_id: str, now: float) -> float | None:
        """Another chunk of ``transfer_id``'s stream arrived (the final one
        too: a stream waits ``ready_ttl_s`` from its last chunk, as a whole
        push does from its one): its pending ready half now expires at
        ``now + ready_ttl_s``, which is returned. A no-op returning None
        when no ready half of it is pending (unknown, matched, closed) or
        that half is already due (``deadline <= now``: it never matches,
        and the next :meth:`expire` drops it)."""
        held = self._ready.get(transfer_id)
        if held is None or held.deadline <= now:
            return None
        deadline = now + self.config.ready_ttl_s
        self._ready[transfer_id] = _Held(deadline, ready=held.ready)
        self._due.set(("ready", transfer_id), deadline)
        return deadline

    def cancel(self, transfer_id: str, reason: str, now: float) -> tuple[Dropped, ...]:
        """Drop whatever is pending for ``transfer_id`` and refuse its later
        messages. Returns nothing after a match: the writer owns the
        transfer then (see :meth:`was_matched`) and must be told directly."""
        if self.was_matched(transfer_id):
            return ()
        sides: tuple[Side, ...] = ("registration", "ready")
        dropped = tuple(
            self._drop(transfer_id, side, f"cancelled: {reason}")
            for side in sides
            if transfer_id in self._side(side)
        )
        self._tomb(transfer_id, "closed", now)
        return dropped

    def expire(self, now: float) -> list[Dropped]:
        """Drop every entry whose deadline is ``<= now`` (earliest first, ties
        by side then transfer id) and forget tombstones that are old enough."""
        out: list[Dropped] = []
        for side, tid in self._due.pop_due(now):
            out.append(self._drop(tid, side, _expiry_reason(side)))
            self._tomb(tid, "closed", now)
        for tid in self._tombs_due.pop_due(now):
            del self._tombs[tid]
            self._claimed_by.pop(tid, None)
        return out

    def next_deadline(self) -> float | None:
        """The earliest pending deadline, for scheduling the next expire()."""
        return self._due.earliest()

    def engines_with_registrations(self) -> set[str]:
        """Decode engines that have registrations pending here (a new set)."""
        return set(self._reg_engines)

    def registrations_of(self, engine_id: str) -> list[Registration]:
        """Pending registrations from decode ``engine_id``."""
        return [
            h.registration
            for h in self._registrations.values()
            if h.registration and h.registration.decode_engine_id == engine_id
        ]

    def ids_for_engine(self, engine_id: str) -> list[str]:
        """Transfer ids pending here for decode ``engine_id`` (either side; a
        late-bound ready KV is no decode's until it is claimed)."""
        regs = [
            t
            for t, h in self._registrations.items()
            if h.registration and h.registration.decode_engine_id == engine_id
        ]
        ready = [
            t
            for t, h in self._ready.items()
            if h.ready and not h.ready.is_late and h.ready.decode_engine_id == engine_id
        ]
        return regs + ready

    def was_matched(self, transfer_id: str) -> bool:
        return self._tombs.get(transfer_id) == "matched"

    def registered_by(self, transfer_id: str) -> str | None:
        """The decode engine whose registration for ``transfer_id`` is
        pending here, or matched it (remembered for the tombstone time);
        None when no registration holds it."""
        held = self._registrations.get(transfer_id)
        if held is not None and held.registration is not None:
            return held.registration.decode_engine_id
        return self._claimed_by.get(transfer_id)

    def is_pending(self, transfer_id: str) -> bool:
        return transfer_id in self._registrations or transfer_id in self._ready

    # -- internals --------------------------------------------------------

    def _add(
        self, tid: str, side: Side, held: _Held, problem: str | None, now: float
    ) -> AddResult:
        if tid in self._tombs:
            if self._tombs[tid] == "closed":
                return Rejected(tid, "closed", f"transfer {tid} was already closed")
            if self._is_other_engine(held, self._claimed_by.get(tid)):
                why = f"transfer {tid} was already claimed by another decode"
                return Rejected(tid, "claimed", why)
            return Rejected(tid, "duplicate", f"transfer {tid} is already matched")
        if tid in self._side(side):
            if self._is_other_engine(held, self.registered_by(tid)):
                why = f"another decode's registration for {tid} is pending"
                return Rejected(tid, "claimed", why)
            return Rejected(tid, "duplicate", f"{side} for {tid} is already pending")
        other: Side = "ready" if side == "registration" else "registration"
        waiting = self._side(other).get(tid)
        reg = held.registration
        if waiting is None and reg is not None and is_prefill_claim(reg.claim_token):
            return Rejected(tid, "unknown_claim", _NOT_HELD)  # holds nothing
        if problem is not None:
            return self._close(tid, other, "invalid", problem, now)
        if waiting is None:
            if len(self) >= self.config.max_pending:
                return Rejected(
                    tid, "capacity", f"{len(self)} transfers already pending"
                )
            self._put(tid, side, held)
            return Pending(tid, side, held.deadline)
        if waiting.deadline <= now:
            return self._close(tid, other, "closed", f"{other} for {tid} expired", now)
        return self._match(tid, side, held, waiting, now)

    def _match(
        self, tid: str, side: Side, held: _Held, waiting: _Held, now: float
    ) -> Matched | Rejected:
        reg_held, ready_held = (
            (held, waiting) if side == "registration" else (waiting, held)
        )
        reg, ready = reg_held.registration, ready_held.ready
        if reg is None or ready is None:  # unreachable: one entry of each side
            raise RuntimeError("matcher state corrupt")
        other: Side = "ready" if side == "registration" else "registration"
        mismatch = self._mismatch(reg, ready)
        if mismatch is not None:
            return self._close(tid, other, "mismatch", mismatch, now)
        self._take(tid, other)
        self._tomb(tid, "matched", now)
        self._claimed_by[tid] = reg.decode_engine_id
        n = self._num_blocks(ready.num_tokens)
        return Matched(
            transfer_id=tid,
            registration=reg,
            ready=ready,
            src_block_ids=groups.span(ready.src_block_ids, reg.first_block, n),
            dst_block_ids=reg.dst_block_ids,
            post_deadline=reg_held.deadline,
        )

    def _close(
        self, tid: str, other: Side, code: RejectCode, reason: str, now: float
    ) -> Rejected:
        """Reject the new entry and drop the other side's, if any."""
        dropped: tuple[Dropped, ...] = ()
        if tid in self._side(other):
            dropped = (self._drop(tid, other, f"closed: {reason}"),)
        self._tomb(tid, "closed", now)
        return Rejected(tid, code, reason, dropped)

    @staticmethod
    def _is_other_engine(held: _Held, engine: str | None) -> bool:
        """``held`` is a registration from another engine than ``engine``."""
        reg = held.registration
        return reg is not None and engine is not None and reg.decode_engine_id != engine

    def _mismatch(self, reg: Registration, ready: ReadyKv) -> str | None:
        problem = _claim_problem(reg, ready)
        if problem is not None:
            return problem
        if reg.num_tokens != ready.num_tokens:
            return (
                f"decode expects {reg.num_tokens} tokens, "
                f"prefill has {ready.num_tokens}"
            )
        if len(ready.src_block_ids) != len(reg.dst_block_ids):
            return (
                f"decode registered {len(reg.dst_block_ids)} KV-cache groups, "
                f"prefill has {len(ready.src_block_ids)}"
            )
        return None

    def _self_problem(
        self, num_tokens: int, first_block: int, count: int
    ) -> str | None:
        n = self._num_blocks(num_tokens)
        if first_block < 0 or count < 1 or first_block + count != n:
            return (
                f"{num_tokens} tokens are {n} blocks, but the registration "
                f"covers blocks {first_block}..{first_block + count - 1}"
            )
        return None

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _side(self, side: Side) -> dict[str, _Held]:
        return self._registrations if side == "registration" else self._ready

    def _put(self, tid: str, side: Side, held: _Held) -> None:
        self._side(side)[tid] = held
        self._due.set((side, tid), held.deadline)
        if held.registration is not None:
            self._reg_engines[held.registration.decode_engine_id] += 1

    def _take(self, tid: str, side: Side) -> _Held:
        held = self._side(side).pop(tid)
        self._due.discard((side, tid))
        if held.registration is not None:
            engine = held.registration.decode_engine_id
            self._reg_engines[engine] -= 1
            if self._reg_engines[engine] <= 0:
                del self._reg_engines[engine]
        return held

    def _drop(self, tid: str, side: Side, reason: str) -> Dropped:
        held = self._take(tid, side)
        return Dropped(tid, side, reason, held.registration, held.ready)

    def _tomb(self, tid: str, kind: _Tomb, now: float) -> None:
        self._tombs[tid] = kind
        self._tombs_due.set(tid, now + self.config.tombstone_ttl_s)
        if kind == "closed":
            self._claimed_by.pop(tid, None)


def _claim_problem(reg: Registration, ready: ReadyKv) -> str | None:
    """Why ``reg`` may not claim ``ready`` (see the module's rule); the
    token itself never goes into the reason."""
    if not ready.is_late:
        if reg.claim_token is not None:
            return "a claim token for a transfer bound early to one decode"
        if reg.decode_engine_id != ready.decode_engine_id:
            return (
                f"registration from {reg.decode_engine_id!r}, but the request "
                f"names decode {ready.decode_engine_id!r}"
            )
        return None
    if reg.claim_token is None:
        return "a late-bound transfer needs the claim token; none came"
    if not hmac.compare_digest(claim_digest(reg.claim_token), ready.claim_sha256 or ""):
        return "the claim token does not match the request's claim digest"
    return None


def _expiry_reason(side: Side) -> str:
    if side == "registration":
        return "expired: prefill's KV was not ready before the registration's deadline"
    return "expired: no registration arrived before the ready KV's deadline"
