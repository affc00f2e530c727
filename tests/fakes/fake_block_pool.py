"""A stand-in for vLLM's ``BlockPool`` (``vllm/v1/core/block_pool.py``),
the part prefill's scheduler pins blocks with: ``blocks``, ``touch`` and
``free_blocks``, with vLLM's reference counts and free queue (a block is
free, and may be handed to another request, only at ``ref_cnt`` 0; a
cached block at 0 stays in the prefix cache until it is handed out), plus
what vLLM itself does to a request's blocks (:meth:`allocate`,
:meth:`free_request`). It refuses what vLLM would corrupt on: a reference
count below 0, or a block freed that nobody holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class FakeBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # in the prefix cache (an eviction candidate)
    is_null: bool = False


class FakeBlockPool:
    """Blocks 1..n-1 start free; block 0 is vLLM's null block."""

    def __init__(self, num_blocks: int = 32) -> None:
        self.blocks = [FakeBlock(i) for i in range(num_blocks)]
        self.blocks[0].is_null = True
        self.free_queue: list[FakeBlock] = self.blocks[1:]
        self.frees: Counter[int] = Counter()  # block id -> free_blocks calls
        self.touches: Counter[int] = Counter()

    # -- the BlockPool surface ---------------------------------------------

    def touch(self, blocks: Sequence[FakeBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_queue.remove(block)  # e.g. a prefix-cache hit
            block.ref_cnt += 1
            self.touches[block.block_id] += 1

    def free_blocks(self, ordered_blocks: Iterable[FakeBlock]) -> None:
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            self.frees[block.block_id] += 1
            if block.ref_cnt == 0 and not block.is_null:
                self.free_queue.append(block)

    # -- what vLLM does to a request's blocks -------------------------------

    def allocate(self, n: int) -> list[int]:
        """``get_new_blocks``: the first ``n`` free blocks, held once."""
        taken, self.free_queue = self.free_queue[:n], self.free_queue[n:]
        for block in taken:
            assert block.ref_cnt == 0
            block.block_hash = None  # evicted from the prefix cache
            block.ref_cnt = 1
        return [b.block_id for b in taken]

    def free_request(self, block_ids: Iterable[int]) -> None:
        """vLLM frees a finished or preempted request's blocks."""
        self.free_blocks([self.blocks[b] for b in block_ids])

    # -- observations --------------------------------------------------------

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id] in self.free_queue

    def refs(self, block_ids: Iterable[int]) -> list[int]:
        return [self.blocks[b].ref_cnt for b in block_ids]

    def held(self) -> dict[int, int]:
        """Blocks anyone still holds, with their reference counts: ``{}``
        once every request and every pin let go."""
        return {b.block_id: b.ref_cnt for b in self.blocks[1:] if b.ref_cnt}
