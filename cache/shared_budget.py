"""One device byte budget for KV blocks and checkpoints, traded by value (``cache/arena.py``).

The pages of the arena go where they are worth most; nothing is split in advance:

* **KV demand** (a request's blocks): a free page, or the page of a free checkpoint slot;
  else the cheapest bytes held: an unreachable KV leaf (no checkpoint in either tier ends
  at or below it: it can never end a hybrid hit), a leaf that only moves to the host, then
  the least valuable device checkpoint (the eviction strategy's ``worth``; its page turns
  into KV blocks, and the KV only it made reachable becomes the next unreachable leaves).
* **Checkpoint demand** (a capture; ``CheckpointStore.grow``): a free page; else a KV page,
  while at least ``headroom`` free blocks stay for the running requests' growth — a wholly
  free one, or the KV page with the most free blocks whose used blocks all belong to
  unpinned tree nodes: those blocks *move* into free blocks of other pages (copies in the
  step plan, ``StepPlan.moves``), after unreachable KV leaves were dropped to make room.
  Failing that, the capture displaces a resident worth less, as with a fixed split.

So a capture takes KV bytes only when they are worth nothing now (free or unreachable) and
KV takes a checkpoint's bytes only by evicting the least valuable one: both directions speak
the value model's one currency. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable

from deltaserve.cache.arena import Arena, PageUse
from deltaserve.cache.block_pool import PagedBlockPool
from deltaserve.cache.checkpoint_store import CheckpointStore
from deltaserve.cache.eviction import CheckpointEviction
from deltaserve.cache.radix_tree import Node, RadixTree

#: partly used KV pages looked at per vacate (the most free blocks first)
VACATE_CANDIDATES = 8


def unreachable(node: Node) -> bool:
    """A device KV leaf that can never end a hybrid hit: no checkpoint at it (either tier)
    and nothing below it."""
    return node.checkpoint_slot is None and node.host_slot is None and not node.children


class SharedBudget:
    def __init__(
        self,
        arena: Arena,
        blocks: PagedBlockPool,
        tree: RadixTree,
        eviction: CheckpointEviction,
        evict_leaf: Callable[[Node], None],
        headroom: int,
    ) -> None:
        self.arena = arena
        self.blocks = blocks
        self.tree = tree
        self.eviction = eviction
        self.evict_leaf = evict_leaf  # the manager's: drop or demote one device KV leaf
        self.headroom = headroom
        self.ckpts: CheckpointStore | None = None  # set once built (it calls back into ``checkpoint_page``)
        self.moves: list[tuple[int, int]] = []  # planned, not yet handed to a step plan
        self.counters: dict[str, int] = dict.fromkeys(
            ("kv.moved_blocks", "cache.pages_to_kv", "cache.pages_to_checkpoints",
             "checkpoints.evicted_for_kv"), 0)  # fmt: skip

    # ------------------------------------------------------------------ KV demand
    def free_block(self, evict_checkpoints: bool = True) -> bool:
        """Make at least one more device block free; False when nothing can give way."""
        if self._kv_page():
            return True
        ckpts = self.ckpts
        assert ckpts is not None
        leaf = self.eviction.kv_victim(ckpts.residents)
        if leaf is not None and leaf.checkpoint_slot is None:  # unreachable, or only demoted
            self.evict_leaf(leaf)
            return True
        if not evict_checkpoints:
            return False
        weakest = min((n for n in ckpts.residents if not n.ckpt_pins), key=self.eviction.worth, default=None)
        if weakest is not None:
            ckpts.evict(weakest)  # its slot is free: the next call turns its page into KV
            self.counters["checkpoints.evicted_for_kv"] += 1
            return True
        if leaf is not None:
            self.evict_leaf(leaf)
            return True
        return False

    def _kv_page(self) -> bool:
        """One more page of KV blocks from unused bytes: a free page or a free checkpoint slot's."""
        page = self.arena.take(PageUse.KV)
        if page is None:
            ckpts = self.ckpts
            if ckpts is None or ckpts.slots.num_free_checkpoint == 0:
                return False
            page = ckpts.slots.remove_free_checkpoint_slot()
            self.arena.convert(page, PageUse.KV)
        self.blocks.add_page(page)
        self.counters["cache.pages_to_kv"] += 1
        return True

    # ------------------------------------------------------------------ checkpoint demand
    def checkpoint_page(self) -> bool:
        """One more free checkpoint slot from bytes worth nothing now; False when none."""
        page = self.arena.take(PageUse.CHECKPOINT)
        if page is None:
            page = self._vacate()
            if page is None:
                return False
            self.arena.convert(page, PageUse.CHECKPOINT)
        assert self.ckpts is not None
        self.ckpts.slots.add_checkpoint_slot(page)
        self.counters["cache.pages_to_checkpoints"] += 1
        return True

    def _vacate(self) -> int | None:
        """A KV page emptied for a checkpoint (out of the block pool), keeping ``headroom``
        free blocks; None when that takes more than free and unreachable KV."""
        blocks, n = self.blocks, self.blocks.page_blocks
        need = n + self.headroom
        while blocks.num_free < need:  # unreachable KV is worth nothing: it goes first
            leaf = self.tree.peek_evictable_leaf()
            if leaf is None or not unreachable(leaf):
                return None
            self.evict_leaf(leaf)
        page = blocks.wholly_free_page()
        if page is not None:
            blocks.remove_page(page)
            return page
        for page in blocks.pages_by_free()[:VACATE_CANDIDATES]:
            holders = [self.tree.by_block.get(b) for b in blocks.used_in(page)]
            if all(h is not None and not h.ref_count and not h.moving for h in holders):
                self._move_out(page, holders)  # type: ignore[arg-type]
                return page
        return None

    def _move_out(self, page: int, holders: list[Node]) -> None:
        """Move ``holders``' blocks out of ``page`` into free blocks of other pages; the page
        leaves the block pool."""
        blocks, n = self.blocks, self.blocks.page_blocks
        for b in blocks.free_in(page):  # keep the destinations off this page
            blocks.take(b)
        for node in holders:
            dst = blocks.allocate()
            src = self.tree.move(node, dst)
            self.moves.append((src, dst))
        for b in range(page * n, page * n + n):
            blocks.free(b)
        blocks.remove_page(page)
        self.counters["kv.moved_blocks"] += len(holders)

    def take_moves(self) -> list[tuple[int, int]]:
        """The copies planned since the last call, settled: a block moved twice is copied once
        from where its bytes are, and a moved node evicted since needs no copy. No source is
        another move's destination, so the copies may run in any order (or all at once)."""
        origin: dict[int, int] = {}  # destination -> the block its bytes are in now
        for src, dst in self.moves:
            origin[dst] = origin.pop(src, src)
        self.moves = []
        return [(src, dst) for dst, src in origin.items() if dst in self.tree.by_block]

    # ------------------------------------------------------------------ reporting
    def usage(self) -> dict[str, int | float]:
        counts, arena = self.arena.counts, self.arena
        assert self.ckpts is not None
        slots = self.ckpts.slots
        used_pages = (self.blocks.num_blocks - self.blocks.num_free) / arena.page_blocks + (
            slots.num_checkpoint - slots.num_free_checkpoint
        )
        return {
            # the share of the budget's bytes in use, KV and checkpoints together (vLLM's gauge)
            "kv.usage": used_pages / arena.num_pages,
            "cache.pages": self.arena.num_pages,
            "cache.page_blocks": self.arena.page_blocks,
            "cache.pages_kv": counts[PageUse.KV],
            "cache.pages_checkpoint": counts[PageUse.CHECKPOINT],
            "cache.pages_free": counts[PageUse.FREE],
        }

    def check_integrity(self) -> None:
        assert self.ckpts is not None
        self.blocks.check_integrity()
        self.arena.check_integrity(self.blocks.pages, set(self.ckpts.slots.ckpt_state))
        device = {n.block_id: n for n in self.tree.nodes() if n.block_id >= 0}
        assert device == self.tree.by_block, "block -> node map drift"
