"""kvpush's transfer core: pure logic for push-mode KV transfer.

No vLLM, sockets, threads or clocks in here: callers pass ``now`` in, and the
vLLM connector, the side-channel listener and the NIXL writer are thin
adapters around these pieces.

Module map, in the order one request meets them:

* ``messages`` — the wire protocol (Hello, HelloReply, Registration, Cancel,
  Failure, Done), versioned and size-limited, with :func:`encode` and
  :func:`decode`; and :class:`TransferParams`, the typed
  ``kv_transfer_params`` of each leg (:class:`PrefillLeg`,
  :class:`DecodeLeg`).
* ``layout`` — :class:`KvLayout`, where an instance's KV blocks are in
  memory, and the compatibility check between two instances.
* ``matcher`` — prefill's :class:`Matcher`: pairs decode's Registration with
  prefill's :class:`ReadyKv` by transfer id, in either order, with deadlines,
  duplicates, cancel, the prefix-cache slice, and which decode may claim a
  ready KV (early: the one named; late: the holder of the claim token).
* ``work`` — :class:`WorkItem` and the ways to cut a match into items (whole;
  kept for streaming push: per chunk with :class:`ChunkCursor`, per layer);
  the last item notifies.
* ``coalesce`` — block pairs to maximal runs contiguous on both sides, and
  runs to NIXL descriptors.
* ``deadlines`` — :class:`~kvpush.transfer.deadlines.Deadlines`, a lazy
  heap: the earliest deadline and the due keys without scanning the rest
  (the matcher's entries and tombstones).
* ``ledger`` — :class:`Ledger`, decode's destination blocks per transfer
  (exclusive).
* ``timeline`` — :class:`Timeline`, per-transfer event times, JSONL helpers.

One request through push mode: the router assigns a transfer id and sends
both legs. Decode allocates blocks, sends a Registration (after a Hello on
first contact) and records its blocks in its ledger. Prefill computes;
its trigger gives the matcher a ReadyKv. Whichever comes second yields a
Matched; the work functions cut it into items; the writer coalesces each
item into descriptors and posts a WRITE, the last one with a Done
notification; decode releases its hold and starts decoding. A prefill
deadline that passes first yields a Dropped, and decode gets a Failure;
decode's own deadline only quarantines its blocks and asks for that word.
"""

from kvpush.transfer.coalesce import Desc, Run, descriptors, runs
from kvpush.transfer.layout import KvLayout, compat_problem
from kvpush.transfer.ledger import Hold, Ledger
from kvpush.transfer.matcher import (
    Dropped,
    Matched,
    Matcher,
    MatcherConfig,
    Pending,
    ReadyKv,
    Rejected,
)
from kvpush.transfer.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    DecodeLeg,
    Done,
    Failure,
    Hello,
    HelloReply,
    Message,
    PrefillLeg,
    ProtocolError,
    Registration,
    TransferParams,
    claim_digest,
    decode,
    encode,
)
from kvpush.transfer.timeline import EVENTS, Timeline
from kvpush.transfer.work import (
    ChunkCursor,
    WorkItem,
    split_layers,
    split_whole,
)

__all__ = [
    "EVENTS",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "Cancel",
    "ChunkCursor",
    "DecodeLeg",
    "Desc",
    "Done",
    "Dropped",
    "Failure",
    "Hello",
    "HelloReply",
    "Hold",
    "KvLayout",
    "Ledger",
    "Matched",
    "Matcher",
    "MatcherConfig",
    "Message",
    "Pending",
    "PrefillLeg",
    "ProtocolError",
    "ReadyKv",
    "Registration",
    "Rejected",
    "Run",
    "Timeline",
    "TransferParams",
    "WorkItem",
    "claim_digest",
    "compat_problem",
    "decode",
    "descriptors",
    "encode",
    "runs",
    "split_layers",
    "split_whole",
]
