"""kvpush's wire protocol between a decode and a prefill instance.

Two channels carry these messages, both through :func:`encode` and
:func:`decode`:

* the **side channel** (a socket the prefill worker listens on; its host and
  port reach decode in :class:`DecodeLeg`): decode sends :class:`Hello` once
  per prefill peer (again after the connection was lost, or when prefill
  asks with :class:`HelloRequest`), then a :class:`Registration` per
  transfer (from decode's scheduler), :class:`Cancel` when it gives one up,
  a :class:`Heartbeat` every second while it waits on that prefill, and
  a :class:`Reconcile` after the HelloReply that follows a reconnect;
  prefill answers a Hello with :class:`HelloReply`, a Registration from a
  decode boot it does not know with :class:`HelloRequest`, tells decode
  about transfers it will not complete with :class:`Failure` (on the socket
  the Registration came from), and answers every Cancel with a ``Failure``
  once it is sure it will not write (after an in-flight WRITE has ended),
  and every id of a Reconcile it no longer holds with its final word (a
  ``Failure``, or a :class:`Done` for a WRITE that completed); and, bound
  early, prefill's rank 0 tells decode's scheduler the token it sampled
  after the prompt (:class:`FirstToken`, on the Registration's socket);
* the **NIXL notification** posted with the last WRITE of a transfer carries a
  :class:`Done`, so decode learns the data landed with no extra message.

With tensor parallelism every worker rank is an endpoint
(:mod:`kvpush.transfer.ranks`): decode's scheduler sends its one
Registration, and any Cancel of its own, to every prefill rank's side
channel; each decode worker rank says Hello (naming its rank) to, and
beats, cancels and reconciles with, the prefill ranks it receives from;
each prefill rank writes its own KV and names itself in its HelloReply,
Done and Failure.

On the wire a message is the msgpack array ``[version, body]``, where body is
a map tagged by its ``"type"`` field. :func:`decode` checks the size first,
then reads the envelope with the body left undecoded and checks
``version == PROTOCOL_VERSION``, then the tag, and only then decodes and
validates the body. Every problem raises :class:`ProtocolError`, and nothing
else escapes, so a listener survives any input. No pickle anywhere.

:class:`TransferParams` is the typed form of the ``kv_transfer_params`` dict
the router puts on each leg of a request; the connector converts it once, at
the edge, with :meth:`TransferParams.from_dict`.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from kvpush.transfer import groups
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.ranks import MAX_TP_SIZE

# 4: Reconcile; Done also on the side channel. 5: late binding (a
# Registration may carry the claim token of a PrefillLeg that named no decode).
# 6: tensor-parallel ranks (Hello names decode's rank and TP size; HelloReply,
# Done and Failure the prefill rank that says them; a DecodeLeg prefill's TP;
# a Hello the model's KV heads, a Registration decode's TP: heterogeneous TP)
# 7: KV digests (a Done may carry the digest of the bytes its rank wrote;
# Cause digest_mismatch, decode's own verdict)
# 8: FirstToken (prefill tells an early-bound decode the token it sampled)
# 9: a Registration names one block list per KV-cache group
PROTOCOL_VERSION = 9
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_METADATA_BYTES = 2 * 1024 * 1024
MAX_BLOCKS_PER_MESSAGE = 262_144
MAX_GROUPS = 64  # KV-cache groups of one model
MAX_IDS_PER_MESSAGE = 4096  # transfer ids in one Reconcile (~0.5 MiB at most)
MAX_TTL_S = 3600.0

TransferId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# Late binding: the router draws a claim token per attempt
# (``secrets.token_urlsafe(32)``) and gives it only to the decode it picks;
# prefill's leg carries only its SHA-256, so prefill never holds the token.
ClaimToken = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{32,128}$")]
ClaimSha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


def claim_digest(token: str) -> str:
    """The SHA-256 (lowercase hex) of a claim token: what a late-bound
    :class:`PrefillLeg` carries as ``claim_sha256``."""
    return hashlib.sha256(token.encode()).hexdigest()


Text = Annotated[str, msgspec.Meta(max_length=1024)]
# A worker's tensor-parallel rank and an instance's TP size
# (:mod:`kvpush.transfer.ranks`); 0 and 1 on an instance without TP.
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_SIZE)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
KvHeads = Annotated[int, msgspec.Meta(ge=0, le=2**16)]  # 0: not known
BlockIds = Annotated[
    tuple[Annotated[int, msgspec.Meta(ge=0, lt=2**31)], ...],
    msgspec.Meta(max_length=MAX_BLOCKS_PER_MESSAGE),
]
GroupBlockIds = Annotated[  # one list per KV-cache group
    tuple[Annotated[BlockIds, msgspec.Meta(min_length=1)], ...],
    msgspec.Meta(min_length=1, max_length=MAX_GROUPS),
]


class Cause(enum.Enum):
    """Why a transfer did not complete: carried by :class:`Failure` (prefill's
    final word) and used by decode for its own verdicts. Counted as
    ``failed.<value>`` (prefill) and ``receive_failed.<value>`` (decode)."""

    EXPIRED = "expired"  # a deadline passed (prefill's or decode's)
    CANCELLED = "cancelled"  # decode or prefill gave the transfer up
    REJECTED = "rejected"  # invalid, mismatched, or blocks beyond decode's cache
    WRITE_FAILED = "write_failed"  # post refused, NIXL ERR, KV never ready
    INCOMPATIBLE = "incompatible"  # prefill refused decode's Hello
    PREEMPTED = "preempted"  # vLLM preempted the prefill request before its WRITE
    PEER_LOST = "peer_lost"  # the other side is gone (or fell silent)
    SEND_FAILED = "send_failed"  # decode could not send its Registration
    DIGEST_MISMATCH = "digest_mismatch"  # decode: the KV landed, not intact


# Why a received message was dropped (the ``kind`` of a ProtocolError).
RejectKind = Literal["oversize", "version", "unknown_type", "malformed", "auth"]


class ProtocolError(Exception):
    """A message that cannot be sent or accepted; ``reason`` says why.

    Raised by :func:`encode` and :func:`decode` only. The receiver drops the
    message (and may log the reason); its own state is unchanged."""

    def __init__(self, reason: str, kind: RejectKind = "malformed") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind: RejectKind = kind


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """Decode → prefill, once per peer before its first Registration: who
    decode is, the NIXL agent metadata prefill loads to write into decode's
    memory, and decode's KV layout (prefill checks it with
    :func:`~kvpush.transfer.layout.compat_problem`). ``boot_id`` names this
    start of the decode instance (the same in its scheduler and worker): a
    Hello with a new boot id means decode restarted, and prefill drops every
    registration of the old boot instead of writing into reused memory.
    One Hello per decode worker rank: ``rank`` is the sender's TP rank and
    ``tp_size`` decode's TP size, ``total_kv_heads`` the model's KV heads
    (0: not known, which pairs equal TP sizes only); prefill refuses a pair
    of TP sizes it cannot map, a head count other than its own, or a rank it
    does not write to (:class:`~kvpush.transfer.ranks.TpPair`)."""

    engine_id: Name
    boot_id: Name
    agent_name: Name
    nixl_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_METADATA_BYTES)]
    layout: KvLayout
    rank: Rank = 0
    tp_size: TpSize = 1
    total_kv_heads: KvHeads = 0

    def __post_init__(self) -> None:
        if self.rank >= self.tp_size:
            raise ValueError("rank must be below tp_size")


class HelloReply(msgspec.Struct, frozen=True, tag="hello_reply"):
    """Prefill → decode: whether prefill accepted the Hello (``reason`` when
    not). ``boot_id`` names this start of the prefill worker: a reply with
    another boot id than the last one proves that the old prefill process,
    and any WRITE it had posted, is gone. ``rank``: the prefill worker
    rank that answers (each rank has its own side channel)."""

    engine_id: Name
    accepted: bool
    boot_id: Name
    reason: Text = ""
    rank: Rank = 0


class HelloRequest(msgspec.Struct, frozen=True, tag="hello_request"):
    """Prefill → decode (on the Registration's socket): "I do not know your
    boot ``decode_boot_id``; say Hello". Sent when a Registration arrives
    from a decode prefill has not heard a Hello from, or has forgotten (it
    fell silent); the transfer waits for that Hello until its deadline.
    Not a final word: the transfer is still open."""

    engine_id: Name
    decode_boot_id: Name
    transfer_id: TransferId


class Registration(msgspec.Struct, frozen=True, tag="registration"):
    """Decode → prefill: "write transfer ``transfer_id`` into these blocks".

    ``dst_block_ids`` holds one list per KV-cache group, all of one length
    (:mod:`kvpush.transfer.groups`): ``dst_block_ids[g][i]`` receives
    prompt block ``first_block + i`` of group ``g``. Decode
    skips the first ``first_block`` blocks because its prefix cache already
    holds them (vLLM's hits are whole blocks); 0 when nothing is cached.
    ``num_tokens`` is the prompt length decode expects, so
    ``first_block + len(dst_block_ids[g]) == ceil(num_tokens / block_size)``.
    ``ttl_s`` is how long decode waits before it asks for prefill's final
    word, counted from sending; relative because the two clocks are not
    synchronised. Prefill posts no WRITE after arrival + ``ttl_s`` − its
    post margin. Decode owns the destination blocks throughout; it frees
    them on Done, on Failure, or once the prefill process is proven gone,
    never when a deadline passes (see ``docs/design.md``, R1 "The timing
    rule"). ``decode_boot_id`` is the boot id of the
    decode that owns the blocks: prefill writes only after a Hello with that
    same boot id (the epoch fence against writing into a restarted decode).
    ``claim_token`` is the token of the decode's :class:`DecodeLeg`, set
    only for a late-bound transfer: prefill writes a ready KV whose leg
    named no decode only for the registration whose token hashes to the
    leg's ``claim_sha256`` (see :mod:`kvpush.transfer.matcher`).
    ``decode_tp`` is decode's TP size: with prefill's own TP size and KV
    heads it says which decode ranks this prefill rank writes (none: a
    replicated copy nobody reads, which frees its blocks at once)."""

    transfer_id: TransferId
    decode_engine_id: Name
    decode_boot_id: Name
    dst_block_ids: GroupBlockIds
    num_tokens: Annotated[int, msgspec.Meta(ge=1)]
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_TTL_S)]
    first_block: Annotated[int, msgspec.Meta(ge=0)] = 0
    claim_token: ClaimToken | None = None
    decode_tp: TpSize = 1

    def __post_init__(self) -> None:
        lengths = {len(g) for g in self.dst_block_ids}
        if len(lengths) > 1:
            raise ValueError(
                f"dst_block_ids needs groups of one length, not {sorted(lengths)}"
            )
        if groups.total(self.dst_block_ids) > MAX_BLOCKS_PER_MESSAGE:
            raise ValueError(f"more than {MAX_BLOCKS_PER_MESSAGE} block ids")
        problem = groups.distinct_problem(self.dst_block_ids)
        if problem is not None:
            raise ValueError(f"dst_block_ids: {problem}")

    @property
    def num_blocks(self) -> int:
        """Prompt blocks registered (each group's length)."""
        return len(self.dst_block_ids[0]) if self.dst_block_ids else 0


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    """Decode → prefill: decode gave the transfer up (request aborted,
    finished before registering, or decode's deadline passed); do not write.
    Prefill answers with its final word (a :class:`Failure`, or the Done of a
    WRITE already under way, then a Failure). Decode keeps registered
    destination blocks until that final word, or until the prefill process
    is proven gone; never merely because time passed."""

    transfer_id: TransferId
    engine_id: Name
    reason: Text = ""


class Failure(msgspec.Struct, frozen=True, tag="failure"):
    """Prefill → decode: prefill will not write this transfer, now or later
    (its final word: no WRITE of it is in flight or can still be posted).
    Decode frees its blocks and falls back. ``rank``: the prefill worker
    rank whose final word it is (for decode's own verdict on a Registration
    it could not send, the rank it was not sent to); a Failure from any
    rank fails the transfer on every decode rank."""

    transfer_id: TransferId
    engine_id: Name
    cause: Cause
    detail: Text = ""
    rank: Rank = 0


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """Decode → prefill, about once a second while decode waits on transfers
    from that prefill: decode is alive. A prefill that hears nothing from a
    decode with registered transfers for its peer timeout drops them."""

    engine_id: Name
    boot_id: Name


class Reconcile(msgspec.Struct, frozen=True, tag="reconcile"):
    """Decode → prefill, on decode's worker socket right after the
    HelloReply that follows a lost connection: the transfers decode still
    waits on from this prefill (``boot_id`` is decode's). Messages prefill
    sent while the connection was down are lost (its ROUTER drops them), so
    prefill answers every id it no longer holds (not waiting to match, to
    post, or in flight) with its final word, on this socket: the
    :class:`Failure` it sent, a :class:`Done` if that transfer's WRITE
    completed, else ``Failure(peer_lost)``; and it closes each such id for
    good (a Registration that comes later under it is refused). Ids it
    still holds carry on; their final word comes on this socket. Decode
    frees blocks only on those answers (see ``docs/design.md``, R1 "The
    timing rule"). More ids than :data:`MAX_IDS_PER_MESSAGE` go in several
    messages."""

    engine_id: Name
    boot_id: Name
    transfer_ids: Annotated[
        tuple[TransferId, ...],
        msgspec.Meta(min_length=1, max_length=MAX_IDS_PER_MESSAGE),
    ]

    def __post_init__(self) -> None:
        if len(set(self.transfer_ids)) != len(self.transfer_ids):
            raise ValueError("transfer_ids must not repeat an id")


class Done(msgspec.Struct, frozen=True, tag="done"):
    """Prefill → decode, as the NIXL notification of a transfer's last WRITE:
    all ``num_blocks`` registered blocks hold the prompt's KV. Also sent on
    the side channel in answer to a :class:`Reconcile`, for a WRITE NIXL
    reported complete (NIXL's DONE: the data landed). ``rank``: the prefill
    worker rank that wrote it; decode's receive is over once every prefill
    rank it expects said its final word. ``digest`` (KV verification, only
    for a transfer the policy selects, on the NIXL notification): the
    :mod:`kvpush.transfer.digest` of every byte this rank wrote to the
    receiving decode rank in this transfer; decode checks it against its
    own memory before the receive counts as done."""

    transfer_id: TransferId
    engine_id: Name
    num_blocks: Annotated[int, msgspec.Meta(ge=0)]
    rank: Rank = 0
    digest: Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)] | None = None


MAX_SAMPLE_LOGPROBS = 1024  # top logprobs one FirstToken carries, at most


class SampleLogprobs(msgspec.Struct, frozen=True):
    """vLLM's logprobs of one sampled position, as its sampler gives them:
    the sampled token's id and logprob first, then the top ones in order;
    ``rank`` is the sampled token's rank in the vocabulary."""

    token_ids: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=0)], ...],
        msgspec.Meta(min_length=1, max_length=MAX_SAMPLE_LOGPROBS + 1),
    ]
    logprobs: Annotated[
        tuple[float, ...],
        msgspec.Meta(min_length=1, max_length=MAX_SAMPLE_LOGPROBS + 1),
    ]
    rank: Annotated[int, msgspec.Meta(ge=1)]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"{len(self.token_ids)} token ids for {len(self.logprobs)} logprobs"
            )


class FirstToken(msgspec.Struct, frozen=True, tag="first_token"):
    """Prefill → decode's scheduler, on the socket the transfer's
    Registration came from (early binding only: a late leg already starts
    from it): the token prefill sampled after the prompt, the one the
    router streamed to the client. Decode's scheduler continues from it
    rather than computing it again (:mod:`kvpush.connector.decode.first_token`).
    Advisory: it changes no transfer's state, and a decode that gets it
    late or not at all computes the token itself."""

    transfer_id: TransferId
    engine_id: Name
    token_id: Annotated[int, msgspec.Meta(ge=0)]
    # the token's logprobs where the request asked for them (prefill's
    # scheduler class sends them), so decode's output carries prefill's
    logprobs: SampleLogprobs | None = None


Message = (
    Hello
    | HelloReply
    | HelloRequest
    | Registration
    | Cancel
    | Failure
    | Heartbeat
    | Reconcile
    | Done
    | FirstToken
)
MESSAGE_TYPES: tuple[type, ...] = (
    Hello,
    HelloReply,
    HelloRequest,
    Registration,
    Cancel,
    Failure,
    Heartbeat,
    Reconcile,
    Done,
    FirstToken,
)
_TAGS = frozenset(
    str(t.__struct_config__.tag)  # type: ignore[attr-defined]
    for t in MESSAGE_TYPES
)


class _Envelope(msgspec.Struct, array_like=True):
    version: int
    body: msgspec.Raw


class _TagOnly(msgspec.Struct):
    type: str


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_Envelope)
_TAG_DECODER = msgspec.msgpack.Decoder(_TagOnly)
_BODY_DECODER = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Serialise ``msg`` for either channel. Validates it as the receiver
    would, so a bad message fails here, on the sender, with the reason."""
    if not isinstance(msg, MESSAGE_TYPES):
        raise ProtocolError(f"not a kvpush message: {type(msg).__name__}")
    data = _ENCODER.encode((PROTOCOL_VERSION, msg))
    decode(data)
    return data


def decode(data: bytes) -> Message:
    """Parse one message received from a peer, or raise :class:`ProtocolError`."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}",
            "oversize",
        )
    envelope = _decode_part(_ENVELOPE_DECODER, data, "envelope")
    if envelope.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {envelope.version} is not supported "
            f"(this side speaks {PROTOCOL_VERSION})",
            "version",
        )
    body = bytes(envelope.body)
    tag = _decode_part(_TAG_DECODER, body, "message header").type
    if tag not in _TAGS:
        raise ProtocolError(f"unknown message type {tag[:64]!r}", "unknown_type")
    return _decode_part(_BODY_DECODER, body, f"{tag} message")  # type: ignore[no-any-return]


def _decode_part(decoder: msgspec.msgpack.Decoder[Any], data: bytes, what: str) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from None


class TransferParams(msgspec.Struct, frozen=True, tag_field="role", omit_defaults=True):
    """The ``kv_transfer_params`` of one leg of a kvpush request, typed.

    Built by the router (``to_dict`` goes into the request body) and parsed
    by the connector's scheduler side with :meth:`from_dict`. The concrete
    type says the leg: :class:`PrefillLeg` or :class:`DecodeLeg`. Both carry
    the router-assigned ``transfer_id``, unique per request, which is the only
    key registrations and finished KV are paired by. Fields left at their
    default (``None``) are left out of :meth:`to_dict`."""

    transfer_id: TransferId

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PrefillLeg | DecodeLeg:
        """Validate and convert; ``ValueError`` says what is wrong. Keys this
        type does not know are ignored (vLLM may add its own)."""
        if not isinstance(d, Mapping):
            raise ValueError(
                f"kv_transfer_params must be a JSON object, not {type(d).__name__}"
            )
        try:
            return msgspec.convert(dict(d), PrefillLeg | DecodeLeg)
        except msgspec.ValidationError as exc:
            raise ValueError(
                f"invalid kvpush kv_transfer_params: {exc}. Expected role "
                "'prefill' with transfer_id and exactly one of "
                "decode_engine_id (early binding) or claim_sha256 (late "
                "binding: 64 lowercase hex digits), or role 'decode' with "
                "transfer_id, prefill_engine_id, prefill_host and "
                "prefill_port (and claim_token, 32-128 URL-safe characters, "
                "for late binding; prefill_tp, prefill's TP size, default 1)"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict, ``role`` included, that :meth:`from_dict` reads."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


class PrefillLeg(TransferParams, frozen=True, tag="prefill"):
    """Prefill's leg: compute the prompt, then push it to the decode that
    registers for it. Exactly one of the two is set:

    * ``decode_engine_id`` (early binding): only that decode engine may
      register (a Registration from another is rejected);
    * ``claim_sha256`` (late binding: the router picks the decode once
      prefill answered): any decode engine whose Registration carries the
      claim token with this SHA-256 (hex) may, once.

    ``ends_if_stopped``: the router ends the client's request if this leg
    stops at its first token (``finish_reason`` "stop": end of sequence, a
    stop token or string), and then sends no decode leg; prefill drops the
    KV at once instead of holding it to the ready deadline (a late leg
    whose first token is the client's). ``ends_at_first_token``: the same
    whatever the finish reason, because the client asked for one token
    (``max_tokens`` 1 under a forced late binding)."""

    decode_engine_id: Name | None = None
    claim_sha256: ClaimSha256 | None = None
    ends_if_stopped: bool = False
    ends_at_first_token: bool = False

    def __post_init__(self) -> None:
        if (self.decode_engine_id is None) == (self.claim_sha256 is None):
            raise ValueError(
                "a prefill leg names exactly one of decode_engine_id (early "
                "binding) and claim_sha256 (late binding)"
            )

    @property
    def is_late(self) -> bool:
        """Late-bound: no decode named; claimed by a token."""
        return self.claim_sha256 is not None


class DecodeLeg(TransferParams, frozen=True, tag="decode"):
    """Decode's leg: allocate blocks and register them with the prefill
    engine ``prefill_engine_id`` whose side channel listens on
    ``prefill_host:prefill_port``. ``claim_token`` (late binding only)
    goes into the Registration: it is what lets this decode claim a
    prefill leg that named no decode. ``prefill_tp`` is the prefill
    instance's TP size: its rank ``r`` listens on ``prefill_port + r``
    (:mod:`kvpush.transfer.ranks`), and decode registers with every rank.
    ``num_kv_tokens``, when set, is how many of the request's prompt tokens
    prefill computed and pushes: the first ones, the rest decode computes
    (late binding with the first token from prefill: decode's prompt ends
    with that token, and its first step computes it)."""

    prefill_engine_id: Name
    prefill_host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    prefill_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    claim_token: ClaimToken | None = None
    prefill_tp: TpSize = 1
    num_kv_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        if self.prefill_port + self.prefill_tp - 1 > 65535:
            raise ValueError("prefill_port + prefill_tp - 1 must be a port number")
