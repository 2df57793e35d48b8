"""One host byte budget in pages of one checkpoint's size: each page is exactly one of FREE,
KV (``page_blocks`` host blocks) or CHECKPOINT (host slot id = the page). The host tier
(``cache/host_tier.py``) owns one and decides what goes; this only keeps the books. Torch-free.
"""

from __future__ import annotations

import heapq

from deltaserve.cache.radix_tree import Node

FREE, KV, CHECKPOINT = 0, 1, 2  # what a host page holds


class HostPages:
    """One host byte budget in pages of one checkpoint's size (see the module docstring).

    Invariants (``check``): every page is exactly one of FREE (in ``free_pages``), KV
    (``used[page]`` blocks held, the rest in ``free_blocks[page]``; in ``open_pages`` while
    some block is free) or CHECKPOINT (its id is a host slot); a KV page with no block held
    is FREE again at once. Pure bookkeeping over ints.
    """

    def __init__(self, num_pages: int, page_blocks: int) -> None:
        if num_pages <= 0 or page_blocks <= 0:
            raise ValueError(f"host pages: {num_pages} pages of {page_blocks} blocks")
        self.num_pages = num_pages
        self.page_blocks = page_blocks
        self.kind = [FREE] * num_pages
        self.free_pages: dict[int, None] = dict.fromkeys(range(num_pages))  # an ordered set
        self.used = [0] * num_pages
        self.free_blocks: list[list[int]] = [[] for _ in range(num_pages)]
        self.open_pages: dict[int, None] = {}  # KV pages with a free block
        self.open_free = 0  # free blocks on the open pages

    @property
    def num_blocks(self) -> int:
        return self.num_pages * self.page_blocks

    def page_of(self, block: int) -> int:
        return block // self.page_blocks

    def can_allocate_block(self) -> bool:
        return bool(self.open_pages or self.free_pages)

    def allocate_block(self, avoid: int = -1) -> int:
        """A host block: from a KV page with room (not page ``avoid``), else a free page
        turned KV."""
        page = next((p for p in self.open_pages if p != avoid), -1)
        if page < 0:
            page = self._take_page(KV)
            n = self.page_blocks
            self.free_blocks[page] = list(range(page * n + n - 1, page * n - 1, -1))
            self.open_pages[page] = None
            self.open_free += n
        block = self.free_blocks[page].pop()
        self.used[page] += 1
        self.open_free -= 1
        if not self.free_blocks[page]:
            del self.open_pages[page]
        return block

    def emptiest_open(self, count: int) -> list[int]:
        """Up to ``count`` open KV pages, fewest blocks held first: the cheapest to vacate."""
        return heapq.nsmallest(count, self.open_pages, key=self.used.__getitem__)

    def free_block(self, block: int) -> None:
        page = self.page_of(block)
        if self.kind[page] != KV or block in self.free_blocks[page]:
            raise RuntimeError(f"free of host block {block}: not held")
        self.used[page] -= 1
        if self.used[page] == 0:  # wholly free: a page again, for either kind
            self.open_free -= len(self.free_blocks[page])
            self.free_blocks[page] = []
            self.open_pages.pop(page, None)
            self.kind[page] = FREE
            self.free_pages[page] = None
            return
        self.free_blocks[page].append(block)
        self.open_free += 1
        self.open_pages[page] = None

    def allocate_slot(self) -> int:
        return self._take_page(CHECKPOINT)

    def free_slot(self, slot: int) -> None:
        if self.kind[slot] != CHECKPOINT:
            raise RuntimeError(f"free of host checkpoint page {slot}: not a checkpoint page")
        self.kind[slot] = FREE
        self.free_pages[slot] = None

    def _take_page(self, kind: int) -> int:
        page = next(iter(self.free_pages))
        del self.free_pages[page]
        self.kind[page] = kind
        return page

    def counts(self) -> dict[int, int]:
        out = dict.fromkeys((FREE, KV, CHECKPOINT), 0)
        for k in self.kind:
            out[k] += 1
        return out

    def check(self, held_blocks: dict[int, Node], slots: dict[int, Node]) -> None:
        """Every page exactly one of free / KV / checkpoint; every block of a KV page free or
        held by one node (``held_blocks``); checkpoint pages = the host slots (``slots``)."""
        n = self.page_blocks
        held_by_page: dict[int, list[int]] = {}
        for b in held_blocks:
            assert 0 <= b < self.num_blocks, f"host block {b} out of range"
            held_by_page.setdefault(self.page_of(b), []).append(b)
        for page in range(self.num_pages):
            kind, held, free = self.kind[page], held_by_page.get(page, []), self.free_blocks[page]
            assert (page in self.free_pages) == (kind == FREE), f"host page {page}: free list drift"
            assert (page in slots) == (kind == CHECKPOINT), f"host page {page}: checkpoint page drift"
            if kind != KV:
                assert not held and not free, f"host page {page}: blocks on a non-KV page"
                continue
            assert held, f"host page {page}: a KV page with no block held is not freed"
            assert self.used[page] == len(held), f"host page {page}: used count drift"
            assert len(set(free)) == len(free) and not set(free) & set(held), (
                f"host page {page}: block free and held"
            )
            assert sorted(free + held) == list(range(page * n, page * n + n)), (
                f"host page {page}: blocks leaked"
            )
            assert (page in self.open_pages) == bool(free), f"host page {page}: open list drift"
        assert all(self.kind[p] == KV for p in self.open_pages), "open page not a KV page"
        assert self.open_free == sum(len(self.free_blocks[p]) for p in self.open_pages), (
            "free blocks on open pages: count drift"
        )
