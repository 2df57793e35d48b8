"""One byte budget for KV blocks and checkpoints: pages that hold one or the other.

A *page* has the bytes of one checkpoint (rounded up to whole KV blocks): it holds either
one checkpoint slot or ``page_blocks`` KV blocks. Page ``p`` is checkpoint slot ``p`` and
KV blocks ``[p * page_blocks, (p + 1) * page_blocks)``; pages ``[first, first + num_pages)``
are shared (below ``first``: the live state slots, never shared). The engine lays its
tensors out the same way (docs/cache.md, "Device memory layout"), so a page changes use
without a copy.

Invariant: every shared page is exactly one of FREE, KV (its blocks are in the block
pool) or CHECKPOINT (its slot is in the state pool). A page changes use only when wholly
unused: a KV page with every block free, a checkpoint page whose slot is free. Which
bytes to give up is the cache manager's choice, by value. Torch-free.
"""

from __future__ import annotations

import enum
from collections import deque


def blocks_per_page(state_bytes: int, kv_block_bytes: int) -> int:
    """KV blocks in a page: one checkpoint's bytes rounded up to whole blocks (at least one)."""
    return max(1, -(-max(state_bytes, 1) // max(kv_block_bytes, 1)))


class PageUse(enum.Enum):
    FREE = "free"
    KV = "kv"
    CHECKPOINT = "checkpoint"


class Arena:
    def __init__(self, first: int, num_pages: int, page_blocks: int) -> None:
        if num_pages <= 0 or page_blocks <= 0 or first < 0:
            raise ValueError(f"arena of {num_pages} pages of {page_blocks} blocks from page {first}")
        self.first = first
        self.num_pages = num_pages
        self.page_blocks = page_blocks
        self.use: dict[int, PageUse] = {p: PageUse.FREE for p in range(first, first + num_pages)}
        self._free: deque[int] = deque(self.use)
        self.counts = {u: 0 for u in PageUse}
        self.counts[PageUse.FREE] = num_pages
        self.conversions = 0  # pages that changed from one use to the other

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, use: PageUse) -> int | None:
        """A free page, now in ``use``; None when there is none."""
        if not self._free:
            return None
        page = self._free.popleft()
        self._set(page, use)
        return page

    def give_back(self, page: int) -> None:
        """``page`` (wholly unused by its owner) is free again."""
        if self.use[page] is PageUse.FREE:
            raise RuntimeError(f"page {page} is free already")
        self._set(page, PageUse.FREE)
        self._free.append(page)

    def convert(self, page: int, use: PageUse) -> None:
        """``page`` (wholly unused by its owner) goes straight to the other use."""
        old = self.use[page]
        if old is PageUse.FREE or old is use:
            raise RuntimeError(f"page {page} is {old.value}: cannot convert to {use.value}")
        self._set(page, use)
        self.conversions += 1

    def _set(self, page: int, use: PageUse) -> None:
        self.counts[self.use[page]] -= 1
        self.counts[use] += 1
        self.use[page] = use

    def pages(self, use: PageUse) -> list[int]:
        return [p for p, u in self.use.items() if u is use]

    def check_integrity(self, kv_pages: set[int], checkpoint_pages: set[int]) -> None:
        """Each page in exactly one use, agreeing with the pools (their page sets)."""
        assert kv_pages == set(self.pages(PageUse.KV)), "KV pages drift from the block pool"
        assert checkpoint_pages == set(self.pages(PageUse.CHECKPOINT)), "checkpoint pages drift"
        assert sorted(self._free) == sorted(self.pages(PageUse.FREE)), "free page list drift"
        assert all(self.counts[u] == len(self.pages(u)) for u in PageUse), "page counts drift"
