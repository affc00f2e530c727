"""Work items: the unit prefill's background writer turns into one NIXL WRITE.

A :class:`WorkItem` says "copy these source blocks to these destination
blocks, for these layers". The writer coalesces an item's blocks
(:mod:`kvpush.transfer.coalesce`) and posts it in one WRITE, alone or with
the other items due for that transfer at that moment (pushed per layer,
one item per group of layers, see
:mod:`kvpush.connector.prefill.stream`); it does not care how the transfer
was cut. :func:`split_whole`, :func:`split_layers` and :class:`ChunkCursor`
cut a matched transfer by hand (tests and benchmarks; the writer's
``Stream`` does its own cutting).

Exactly one item per transfer has ``notify=True``: the last one. The writer
must post it only after every earlier item of that transfer has completed,
because NIXL does not order separate transfers; its notification (a
:class:`~kvpush.transfer.messages.Done`) then tells decode that all blocks
landed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpush.transfer import groups
from kvpush.transfer.groups import GroupBlocks


@dataclass(frozen=True)
class WorkItem:
    """Copy ``src_block_ids[g][i]`` → ``dst_block_ids[g][i]`` (one list per
    KV-cache group, :mod:`kvpush.transfer.groups`) in every layer of
    ``layers``; post the transfer's Done notification with it when
    ``notify``. ``ValueError`` on no blocks, groups of unequal counts or
    lengths on the two sides, or a bad range."""

    transfer_id: str
    src_block_ids: GroupBlocks
    dst_block_ids: GroupBlocks
    layers: range
    notify: bool

    def __post_init__(self) -> None:
        src, dst = self.src_block_ids, self.dst_block_ids
        if (
            groups.total(src) == 0
            or len(src) != len(dst)
            or any(len(s) != len(d) for s, d in zip(src, dst, strict=True))
        ):
            raise ValueError(
                "a work item needs the same groups of equal block counts on "
                f"both sides, not all empty; got {[len(g) for g in src]} source "
                f"and {[len(g) for g in dst]} destination blocks"
            )
        if self.layers.step != 1 or self.layers.start < 0 or not self.layers:
            raise ValueError(
                f"layers must be a non-empty step-1 range, not {self.layers}"
            )

    @property
    def num_blocks(self) -> int:
        return groups.total(self.src_block_ids)


def split_whole(
    transfer_id: str, src: GroupBlocks, dst: GroupBlocks, num_layers: int
) -> list[WorkItem]:
    """The whole transfer, all layers, as one notifying item."""
    return [WorkItem(transfer_id, src, dst, range(num_layers), True)]


def split_layers(item: WorkItem, layers_per_item: int = 1) -> list[WorkItem]:
    """Cut ``item`` into consecutive groups of ``layers_per_item`` layers.
    Only the last piece keeps ``item.notify``."""
    if layers_per_item < 1:
        raise ValueError(f"layers_per_item must be >= 1, got {layers_per_item}")
    starts = range(item.layers.start, item.layers.stop, layers_per_item)
    return [
        replace(
            item,
            layers=range(start, min(start + layers_per_item, item.layers.stop)),
            notify=item.notify and start == starts[-1],
        )
        for start in starts
    ]


class ChunkCursor:
    """Streams one matched transfer to decode as prefill computes it.

    Created by the prefill thread that owns the match (from the
    registration: ``dst_block_ids`` per group, ``first_block``, ``num_tokens``);
    :meth:`advance` is called after each prefill step with the request's
    source block ids so far and its computed-token count. It emits items for
    blocks that are now complete and not yet sent: a block is complete when
    all its tokens are computed, or when the whole prompt is (the last block
    may be partial). Blocks before ``first_block`` are decode's prefix hits
    and never sent. The item that reaches the end notifies."""

    def __init__(
        self,
        transfer_id: str,
        dst_block_ids: GroupBlocks,
        first_block: int,
        num_tokens: int,
        block_size: int,
        num_layers: int,
    ) -> None:
        if block_size < 1 or num_layers < 1 or first_block < 0:
            raise ValueError("block_size and num_layers must be >= 1, first_block >= 0")
        self._total = -(-num_tokens // block_size)
        lengths = {len(g) for g in dst_block_ids}
        if not dst_block_ids or lengths != {self._total - first_block}:
            raise ValueError(
                f"{num_tokens} tokens are {self._total} blocks; first_block "
                f"{first_block} + {sorted(lengths)} destination blocks differ"
            )
        self.transfer_id = transfer_id
        self._dst = dst_block_ids
        self._first = first_block
        self._num_tokens = num_tokens
        self._block_size = block_size
        self._layers = range(num_layers)
        self._next = first_block  # prompt block index of the next unsent block

    @property
    def is_done(self) -> bool:
        """True once the notifying item has been emitted."""
        return self._next >= self._total

    def advance(self, src_block_ids: GroupBlocks, num_computed: int) -> list[WorkItem]:
        """Items for newly complete blocks (zero or one item per call).
        ``ValueError`` when fewer source blocks are given than are complete."""
        if num_computed >= self._num_tokens:
            complete = self._total
        else:
            complete = max(num_computed, 0) // self._block_size
        if complete <= self._next:
            return []
        src, dst = groups.aligned(
            src_block_ids, self._dst, self._next, complete, self._first
        )
        self._next = complete
        item = WorkItem(
            transfer_id=self.transfer_id,
            src_block_ids=src,
            dst_block_ids=dst,
            layers=self._layers,
            notify=complete == self._total,
        )
        return [item]
