"""KV block pool: a free list of block ids. Pure bookkeeping, no tensors.

Invariant: a block id is either in the free list or handed out (owned by a request as a
private block, or by a radix-tree node); the cache manager tracks which.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV block pool exhausted")
        block_id = self._free.popleft()
        self._is_free[block_id] = False
        return block_id

    def free(self, block_id: int) -> None:
        if self._is_free[block_id]:
            raise RuntimeError(f"double free of KV block {block_id}")
        self._is_free[block_id] = True
        self._free.append(block_id)

    def free_ids(self) -> list[int]:
        return list(self._free)
