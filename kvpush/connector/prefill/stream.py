"""The stream state of one prefill transfer: its chunks of KV, what of
them was posted, and the next WRITE to cut.

The state of :class:`~kvpush.connector.prefill.transfer.Transfer` (the
record the writer's :class:`~kvpush.connector.prefill.pipeline.Pipeline`
holds per transfer, which adds its phase); pure bookkeeping, no I/O. Every
transfer is a stream: a whole push (``--push-granularity request``) is a
stream of one chunk.

* Chunks arrive in prompt order (:meth:`Stream.add`), each with the device
  fence of the forward that computed it; a block may be sent once its
  chunk's fence, and every earlier chunk's, completed. A chunk pushed per
  layer has a :class:`~kvpush.connector.prefill.fence.LayerFences`: its
  blocks may be sent layer by layer, as each layer's KV is written.
* The stream keeps, per layer, how far that layer was sent. Once matched
  with decode's registration, :meth:`Stream.next_write` cuts what is
  ready and not yet sent (within the registered range: decode's prefix
  hits are never sent) into one WRITE: everything due at once, so a
  registration that arrives after several chunks (or layers) catches up
  in one coalesced WRITE. Its items are block range x layer range pieces,
  one per group of layers that were sent as far and are ready as far.
* The WRITE that completes every layer of the prompt carries the Done; it
  is offered only once no earlier WRITE is in flight (NIXL does not order
  separate WRITEs, and Done tells decode every block landed). Meanwhile the
  rest goes as a WRITE of its own, less the *Done piece*: the last block
  of the last group of layers.
* With tensor parallelism each WRITE goes to every decode rank this
  prefill rank writes (:attr:`Stream.targets`, one head slice each): one
  WRITE per target, each counted in :attr:`Stream.in_flight`, so the Done
  pieces wait for every earlier WRITE to every target; the transfer is
  written once every target's Done WRITE completed (:attr:`Stream.done_ranks`).
* Once :meth:`Stream.close` is called (cancelled, preempted, expired, a
  WRITE failed, decode lost) nothing more is offered; the pipeline frees
  the transfer when its last WRITE in flight ends (:attr:`Stream.in_flight`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.connector.prefill.fence import LayerFences, ReadyFence
from kvpush.transfer import groups
from kvpush.transfer.groups import GroupBlocks
from kvpush.transfer.matcher import Matched, ReadyKv
from kvpush.transfer.messages import Cause
from kvpush.transfer.shares import HeadSlice
from kvpush.transfer.work import WorkItem


@dataclass(frozen=True)
class Closing:
    """Why a stream posts nothing more; ``cause`` None: end without a word
    (nobody is left to tell)."""

    cause: Cause | None
    why: str


@dataclass(frozen=True)
class Span:
    """Layers ``layers`` send prompt blocks ``start..end-1``."""

    layers: range
    start: int
    end: int


@dataclass(frozen=True)
class StreamWrite:
    """One WRITE of a stream: a piece per :class:`Span`, the last one
    carrying the Done when ``notify``."""

    items: tuple[WorkItem, ...]
    spans: tuple[Span, ...]

    @property
    def notify(self) -> bool:
        return self.items[-1].notify


class Stream:
    """The chunks, the registration and the WRITEs of one transfer."""

    def __init__(self, req_id: str, first: ReadyKv, fence: ReadyFence) -> None:
        self.req_id = req_id
        self.transfer_id = first.transfer_id
        self.engine = first.decode_engine_id or ""  # late: known at the match
        self.num_tokens = first.num_tokens
        self.final = False  # the last chunk arrived
        self.matched: Matched | None = None
        self.in_flight = 0  # WRITEs posted, not ended
        self.closing: Closing | None = None
        self.targets: tuple[HeadSlice, ...] = ()  # what goes to which decode rank
        self.done_ranks: set[int] = set()  # targets whose Done WRITE completed
        self.not_before = 0.0  # fault injection: no WRITE before (from the match)
        self._src: list[list[int]] = []  # per KV-cache group: the blocks known
        self._known = 0  # prompt blocks known (each group's length)
        self._chunks: list[tuple[int, ReadyFence]] = []  # (blocks known, fence)
        self._num_whole = 0  # leading chunks whose every layer is written
        self._num_blocks = 0  # prompt blocks; known at the match
        self._num_layers = 0
        self._sent: list[int] = []  # per layer: index of its next unsent block
        self._num_unsent = 0  # layers not sent to the prompt's end
        self.add(first, fence)

    def add(self, chunk: ReadyKv, fence: ReadyFence) -> str | None:
        """The next chunk's blocks are computed (once ``fence`` says so).
        Returns what is wrong with it (the stream is then unchanged)."""
        if self.final:
            return "a chunk after the final one"
        if chunk.first_block != self._known:
            return f"chunk starts at block {chunk.first_block}, not {self._known}"
        if chunk.num_tokens != self.num_tokens:
            return f"chunk of a {chunk.num_tokens}-token prompt, not {self.num_tokens}"
        new = chunk.src_block_ids
        if self._src and len(new) != len(self._src):
            return f"a chunk of {len(new)} KV-cache groups, not {len(self._src)}"
        lengths = {len(g) for g in new}
        if len(lengths) != 1:
            return f"a chunk's groups hold unequal block counts {sorted(lengths)}"
        if groups.distinct_problem(groups.of([*self._src, *new])) is not None:
            return "source block ids repeat"
        if not self._src:
            self._src = [[] for _ in new]
        for ids, more in zip(self._src, new, strict=True):
            ids.extend(more)
        self._known += lengths.pop()
        self._chunks.append((self._known, fence))
        self.final = chunk.final
        return None

    def match(
        self,
        matched: Matched,
        block_size: int,
        num_layers: int,
        targets: tuple[HeadSlice, ...],
    ) -> None:
        """Decode's registration: its blocks from ``first_block`` on, to be
        written as ``targets`` (a late-bound stream learns its decode
        engine here)."""
        self.matched = matched
        self.targets = targets
        self.engine = matched.registration.decode_engine_id
        self._num_blocks = -(-self.num_tokens // block_size)
        self._num_layers = num_layers
        first = matched.registration.first_block
        self._sent = [first] * num_layers
        self._num_unsent = num_layers if first < self._num_blocks else 0

    def close(self, cause: Cause | None, why: str) -> None:
        """Post nothing more (the first reason given is kept)."""
        if self.closing is None:
            self.closing = Closing(cause, why)

    def write_failed(self) -> None:
        """A WRITE of it failed: that is the final word's cause, whatever
        closed the stream before."""
        self.closing = Closing(Cause.WRITE_FAILED, "NIXL reported an error")

    @property
    def target_ranks(self) -> frozenset[int]:
        return frozenset(s.dst_rank for s in self.targets)

    @property
    def is_written(self) -> bool:
        """Every target's Done WRITE completed (the transfer's final word)."""
        return bool(self.targets) and self.done_ranks >= self.target_ranks

    @property
    def is_open(self) -> bool:
        """Matched, not closed, and not every block of every layer posted."""
        return (
            self.matched is not None and self.closing is None and self._num_unsent > 0
        )

    def has_due(self) -> bool:
        """Something known to post, whether or not its fence completed."""
        if not self.is_open:
            return False
        return bool(self._spans([self._end(self._known)] * self._num_layers))

    def waits_on_device(self) -> bool:
        """Whether the first chunk not yet written waits on device work (the
        writer polls its fence) rather than on the worker's next event."""
        for _, fence in self._chunks[self._num_whole :]:
            if not fence.is_ready():
                if isinstance(fence, LayerFences):
                    return fence.waits_on_device()
                return True
        return False

    def next_write(self) -> StreamWrite | None:
        """The WRITE to post now (None: nothing ready). Does not change the
        stream; call :meth:`posted` once it was posted."""
        if not self.is_open or self.matched is None:
            return None
        spans = self._spans([self._end(k) for k in self._ready_known()])
        if not spans:
            return None
        done = self._completes(spans)
        first = self.matched.registration.first_block
        src, dst = self._src, self.matched.dst_block_ids
        items = tuple(
            WorkItem(
                self.transfer_id,
                *groups.aligned(src, dst, s.start, s.end, first),
                layers=s.layers,
                notify=done and i == len(spans) - 1,
            )
            for i, s in enumerate(spans)
        )
        return StreamWrite(items, tuple(spans))

    def posted(self, write: StreamWrite, num_writes: int = 1) -> None:
        """``write`` went out, as ``num_writes`` WRITEs (one per target)."""
        for span in write.spans:
            for layer in span.layers:
                self._sent[layer] = span.end
            if span.end == self._num_blocks:
                self._num_unsent -= len(span.layers)
        self.in_flight += num_writes

    def whole(self) -> tuple[GroupBlocks, GroupBlocks]:
        """Every (source, destination) block pair this transfer writes, per
        KV-cache group: the prompt's blocks from decode's ``first_block`` on
        (what a KV digest covers; known once matched and the final chunk
        came)."""
        if self.matched is None:
            return (), ()
        first = self.matched.registration.first_block
        dst = self.matched.dst_block_ids
        return groups.aligned(self._src, dst, first, self._num_blocks, first)

    def item_ended(self) -> None:
        self.in_flight -= 1

    def _spans(self, ends: list[int]) -> list[Span]:
        """What to send, per group of layers, for ``ends`` (per layer: the
        prompt blocks ready): nothing once closed; while a WRITE is in
        flight, a WRITE that would complete the prompt leaves out its Done
        piece (the last block of its last group), which waits for every
        earlier WRITE."""
        if not self.is_open:
            return []
        spans: list[Span] = []
        start_layer = 0
        sent = self._sent
        for layer in range(1, self._num_layers + 1):
            if (
                layer < self._num_layers
                and sent[layer] == sent[start_layer]
                and ends[layer] == ends[start_layer]
            ):
                continue
            a, b = sent[start_layer], ends[start_layer]
            if b > a:
                spans.append(Span(range(start_layer, layer), a, b))
            start_layer = layer
        if spans and self.in_flight > 0 and self._completes(spans):
            last = spans.pop()
            if last.end - 1 > last.start:
                spans.append(Span(last.layers, last.start, last.end - 1))
        return spans

    def _completes(self, spans: list[Span]) -> bool:
        complete = sum(len(s.layers) for s in spans if s.end == self._num_blocks)
        return complete == self._num_unsent

    def _end(self, known: int) -> int:
        """Prompt blocks complete among the first ``known`` (capped at the
        prompt: trailing blocks of a whole push are ignored)."""
        if self.matched is None:
            return 0
        if known >= self._known and self.final:
            return self._num_blocks
        return min(known, self._num_blocks)

    def _ready_known(self) -> list[int]:
        """Per layer: how many of the prompt's known blocks hold that
        layer's KV (every earlier chunk's fence, for that layer, completed)."""
        num_layers = self._num_layers
        chunks = self._chunks
        while self._num_whole < len(chunks) and chunks[self._num_whole][1].is_ready():
            self._num_whole += 1
        known = chunks[self._num_whole - 1][0] if self._num_whole else 0
        ends = [known] * num_layers
        top = num_layers  # layers below it are written in every chunk so far
        for blocks, fence in chunks[self._num_whole :]:
            ready = fence.num_ready() if isinstance(fence, LayerFences) else 0
            if ready < top:
                ends[ready:top] = [known] * (top - ready)
                top = ready
            if top == 0:
                break
            known = blocks
            ends[:top] = [known] * top
        return ends
