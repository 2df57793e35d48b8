"""KV block pool: a free list of block ids. Pure bookkeeping, no tensors.

Invariant: a block id is either in the free list or handed out (owned by a request as a
private block, or by a radix-tree node); the cache manager tracks which.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator


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

    @property
    def max_blocks(self) -> int:
        return self.num_blocks

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

    def is_valid(self, block_id: int) -> bool:
        return 0 <= block_id < self.num_blocks


class PagedBlockPool:
    """The KV blocks of an arena's KV pages (``cache/arena.py``): the same interface as
    ``BlockPool`` over a block count that grows and shrinks a page at a time.

    Allocation packs: a block comes from the KV page with the fewest free blocks, so free
    blocks gather in few pages and whole pages come free to change use. Invariant: a page's
    blocks are all here (free or handed out) exactly while the page is a KV page.
    """

    def __init__(self, page_blocks: int, max_blocks: int) -> None:
        if page_blocks <= 0:
            raise ValueError(f"page_blocks must be positive, got {page_blocks}")
        self.page_blocks = page_blocks
        self.max_blocks = max_blocks  # every shared page as KV
        self.num_blocks = 0
        self.num_free = 0
        self._free: dict[int, list[int]] = {}  # KV page -> its free block ids
        # pages by free count (1..page_blocks), each an insertion-ordered set
        self._by_free: list[dict[int, None]] = [{} for _ in range(page_blocks + 1)]
        self._is_free: dict[int, bool] = {}  # block id -> free (blocks of KV pages only)

    def page_of(self, block_id: int) -> int:
        return block_id // self.page_blocks

    @property
    def pages(self) -> set[int]:
        return set(self._free)

    def add_page(self, page: int) -> None:
        if page in self._free:
            raise RuntimeError(f"page {page} is a KV page already")
        n = self.page_blocks
        self._free[page] = list(range(page * n + n - 1, page * n - 1, -1))  # lowest id on top
        self._by_free[n][page] = None
        for b in range(page * n, page * n + n):
            self._is_free[b] = True
        self.num_blocks += n
        self.num_free += n

    def remove_page(self, page: int) -> None:
        """``page``, every block free, leaves the pool."""
        free = self._free.get(page)
        n = self.page_blocks
        if free is None or len(free) != n:
            raise RuntimeError(f"page {page} is not a wholly free KV page")
        del self._free[page]
        del self._by_free[n][page]
        for b in range(page * n, page * n + n):
            del self._is_free[b]
        self.num_blocks -= n
        self.num_free -= n

    def allocate(self) -> int:
        for count in range(1, self.page_blocks + 1):
            bucket = self._by_free[count]
            if bucket:
                page = next(iter(bucket))
                del bucket[page]
                if count > 1:
                    self._by_free[count - 1][page] = None
                block_id = self._free[page].pop()
                self._is_free[block_id] = False
                self.num_free -= 1
                return block_id
        raise RuntimeError("KV block pool exhausted")

    def free(self, block_id: int) -> None:
        page = self.page_of(block_id)
        free = self._free.get(page)
        if free is None:
            raise RuntimeError(f"free of KV block {block_id} outside the KV pages")
        if self._is_free[block_id]:
            raise RuntimeError(f"double free of KV block {block_id}")
        count = len(free)
        if count:
            del self._by_free[count][page]
        self._by_free[count + 1][page] = None
        free.append(block_id)
        self._is_free[block_id] = True
        self.num_free += 1

    def take(self, block_id: int) -> None:
        """Hand out the free block ``block_id`` (a migration's destination is chosen by the caller)."""
        page = self.page_of(block_id)
        free = self._free[page]
        if not self._is_free.get(block_id, False):
            raise RuntimeError(f"KV block {block_id} is not free")
        count = len(free)
        del self._by_free[count][page]
        if count > 1:
            self._by_free[count - 1][page] = None
        free.remove(block_id)
        self._is_free[block_id] = False
        self.num_free -= 1

    def free_in(self, page: int) -> list[int]:
        return list(self._free[page])

    def wholly_free_page(self) -> int | None:
        return next(iter(self._by_free[self.page_blocks]), None)

    def pages_by_free(self) -> Iterator[int]:
        """Partly used KV pages, the most free blocks first (lazily: callers look at a few)."""
        return (p for count in range(self.page_blocks - 1, 0, -1) for p in self._by_free[count])

    def used_in(self, page: int) -> list[int]:
        n = self.page_blocks
        return [b for b in range(page * n, page * n + n) if not self._is_free[b]]

    def is_free(self, block_id: int) -> bool:
        """``block_id`` is free (or outside the KV pages)."""
        return self._is_free.get(block_id, True)

    def is_valid(self, block_id: int) -> bool:
        """``block_id`` belongs to a KV page."""
        return block_id in self._is_free

    def free_ids(self) -> list[int]:
        return [b for free in self._free.values() for b in free]

    def check_integrity(self) -> None:
        n = self.page_blocks
        for page, free in self._free.items():
            assert len(set(free)) == len(free), f"page {page}: a free block listed twice"
            assert all(self.page_of(b) == page and self._is_free[b] for b in free), (
                f"page {page}: free list drift"
            )
            assert sum(self._is_free[b] for b in range(page * n, page * n + n)) == len(free), (
                f"page {page}: free flags drift"
            )
            count = len(free)
            assert count == 0 or page in self._by_free[count], f"page {page}: free-count bucket drift"
        assert sum(len(b) for b in self._by_free[1:]) == sum(1 for f in self._free.values() if f), (
            "free-count buckets drift"
        )
        assert self.num_blocks == n * len(self._free), "block count drift"
        assert self.num_free == sum(len(f) for f in self._free.values()), "free count drift"
