"""Paged KV block allocation: one block table per sequence, shared by the target and the draft caches.

The target and the draft each own a KV pool with the same number of blocks, indexed by the same block
table, so a single allocation covers both (the draft pool is small: fewer layers, often fewer heads).
Block 0 is reserved as a scratch block: padding rows of a verify batch write their KV there (slot 0) and
unused block-table entries point at it, so every gather reads finite values that attention masks out.
No prefix caching: blocks belong to exactly one sequence and return to the free list the moment the
sequence finishes, is aborted or is preempted.
"""

from __future__ import annotations

from collections import deque

from dspark_cli.engines.embedded.sequence import Sequence

__all__ = ["SCRATCH_BLOCK", "BlockManager"]

SCRATCH_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (block 0 is scratch)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that positions ``[0, num_tokens)`` have a slot."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s table to cover ``num_tokens`` positions; False (and no change) if the pool is short."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            seq.block_table.append(self._free.popleft())
        return True

    def free(self, seq: Sequence) -> None:
        # Most recently used blocks go to the front: they are likeliest to still be warm in cache.
        for block in reversed(seq.block_table):
            self._free.appendleft(block)
        seq.block_table = []
