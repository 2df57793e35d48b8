"""One device byte budget for KV blocks and checkpoints, traded by value (``cache/arena.py``).

The pages of the arena go where they are worth most; nothing is split in advance:

* **KV demand** (a request's blocks): a free page, or the page of a free checkpoint slot;
  else the cheapest bytes held: an unreachable KV leaf (no checkpoint in either tier ends
  at or below it: it can never end a hybrid hit), a leaf that only moves to the host, then
  the least valuable device checkpoint (the eviction strategy's ``worth``; its page turns
  into KV blocks, and the KV only it made reachable becomes the next unreachable leaves).
* **Checkpoint demand** (a capture; ``CheckpointStore.grow``): a free page; else a KV page,
  while at least ``headroom`` free blocks stay for the running requests' growth (none while
  the checkpoints are below their floor) — a wholly free one, or the KV page with the most
  free blocks: its used blocks (cached, pinned or a request's private ones; not a node being
  copied between tiers) *move* into free blocks of other pages (copies in the step plan,
  ``StepPlan.moves``; block tables follow), after unreachable KV leaves were dropped to make
  room. Failing that, the capture displaces a resident worth less, as with a fixed split.
* **The floor**: checkpoint pages KV may not take while another request could give way
  (below it KV evicts within its own pages, and a new request waits). It follows the two
  costs of short memory in tokens of prefill (``adjust``): hits lost to checkpoints evicted
  for KV or never stored (*ghosts*) push it up; what preempted requests recompute, and the KV
  the floor keeps from a prompt admission holds back for long (``scheduler/kv_reserve.py``),
  pull it down.

So a capture takes KV bytes only when they are worth nothing now (free or unreachable) and
KV takes a checkpoint's bytes only by evicting the least valuable one: both directions speak
the value model's one currency. Torch-free.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable

from deltaserve.cache.arena import Arena, PageUse
from deltaserve.cache.block_pool import PagedBlockPool
from deltaserve.cache.checkpoint_store import CheckpointStore
from deltaserve.cache.eviction import CheckpointEviction
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.state_pool import SlotState
from deltaserve.cache.types import SeqCache

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
        active: Callable[[], Iterable[SeqCache]],
        headroom: int,
        block_size: int,
    ) -> None:
        self.arena = arena
        self.blocks = blocks
        self.tree = tree
        self.eviction = eviction
        self.evict_leaf = evict_leaf  # the manager's: drop or demote one device KV leaf
        self.active = active  # the admitted requests (their block tables follow moved blocks)
        self.headroom = headroom
        self.block_size = block_size
        # checkpoint pages KV demand may not take while another request can give way; it
        # follows the two costs of short memory (``adjust``)
        self.floor = 0
        self.balance = 0  # tokens of imbalance not yet turned into a floor move
        # key -> depth (blocks) of checkpoints evicted for KV or never stored, oldest first
        self.ghosts: OrderedDict[int, int] = OrderedDict()
        self.ghost_capacity = 4 * arena.num_pages
        self.max_floor = arena.num_pages // 2  # KV keeps at least half the pages it may need
        self.ckpts: CheckpointStore | None = None  # set once built (it calls back into ``checkpoint_page``)
        self.moves: list[tuple[int, int]] = []  # planned, not yet handed to a step plan
        self.counters: dict[str, int] = dict.fromkeys(
            ("kv.moved_blocks", "cache.pages_to_kv", "cache.pages_to_checkpoints",
             "checkpoints.evicted_for_kv", "cache.kv_refused"), 0)  # fmt: skip

    # ------------------------------------------------------------------ KV demand
    def free_block(self, force: bool = False, admission: bool = False) -> bool:
        """Make at least one more device block free; False when nothing can give way. While
        the checkpoints hold no more than their floor (and ``force`` is off: another request
        could give way) KV does not take their pages: it evicts within its own."""
        if self._kv_page(force):
            return True
        ckpts = self.ckpts
        assert ckpts is not None
        leaf = self.eviction.kv_victim(ckpts.residents)
        if leaf is not None and leaf.checkpoint_slot is None:  # unreachable, or only demoted
            self.evict_leaf(leaf)
            return True
        if not force and self.arena.counts[PageUse.CHECKPOINT] <= self.floor:
            # the checkpoints' pages are theirs: KV makes room within its own, as with a fixed
            # split (the leaf goes, its checkpoint with it, down to the host when it takes them)
            if leaf is None or admission:  # a new request waits rather than eat into them
                self.counters["cache.kv_refused"] += 1
                return False
            self.evict_leaf(leaf)
            return True
        weakest = min((n for n in ckpts.residents if not n.ckpt_pins), key=self.eviction.worth, default=None)
        if weakest is not None:
            self.ghost(weakest.key, weakest.depth)
            ckpts.evict(weakest)  # its slot is free: the next call turns its page into KV
            self.counters["checkpoints.evicted_for_kv"] += 1
            return True
        if leaf is not None:
            self.evict_leaf(leaf)
            return True
        return False

    # ------------------------------------------------------------------ the floor
    def ghost(self, key: int, depth: int) -> None:
        """A checkpoint that more checkpoint memory would hold (evicted for KV, or a capture
        that found no room): ``key`` of its last block, ``depth`` in blocks."""
        self.ghosts[key] = depth
        self.ghosts.move_to_end(key)
        while len(self.ghosts) > self.ghost_capacity:
            self.ghosts.popitem(last=False)

    def on_query(self, hashes: list[int], limit_blocks: int, hit_tokens: int) -> None:
        """An admitted prompt: the tokens a checkpoint evicted for KV would have added to its
        hit count for the checkpoints (see ``adjust``)."""
        if not self.ghosts:
            return
        hit_blocks = hit_tokens // self.block_size
        for i in range(min(limit_blocks, len(hashes)) - 1, hit_blocks - 1, -1):
            depth = self.ghosts.get(hashes[i])
            if depth is not None and depth == i + 1:
                self.adjust((depth - hit_blocks) * self.block_size)
                return

    def adjust(self, tokens: int) -> None:
        """Move the floor a page per page of KV tokens of imbalance: hits lost to checkpoints
        evicted for KV (up) against what preempted requests recompute — computed tokens when
        preempted (down), less what the cache serves them when they come back (up). The same
        currency, tokens of prefill, so the floor settles where the two margins meet."""
        self.balance += tokens
        step = self.blocks.page_blocks * self.block_size
        while self.balance >= step and self.floor < self.max_floor:
            self.balance -= step
            self.floor += 1
        while self.balance <= -step and self.floor > 0:
            self.balance += step
            self.floor -= 1
        self.balance = max(min(self.balance, step), -step)

    def _kv_page(self, force: bool = False) -> bool:
        """One more page of KV blocks from unused bytes: a free page or a free checkpoint slot's
        (not while the checkpoints are below their floor: those bytes are theirs)."""
        counts = self.arena.counts
        if not force and counts[PageUse.KV] >= self.arena.num_pages - self.floor:
            return False
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
        below_floor = self.arena.counts[PageUse.CHECKPOINT] < self.floor
        need = n + (0 if below_floor else self.headroom)
        while blocks.num_free < need:  # unreachable KV is worth nothing: it goes first
            leaf = self.tree.peek_evictable_leaf()
            if leaf is None or not unreachable(leaf):
                return None
            self.evict_leaf(leaf)
        page = blocks.wholly_free_page()
        if page is not None:
            blocks.remove_page(page)
            return page
        by_block = self.tree.by_block
        for page in itertools.islice(blocks.pages_by_free(), VACATE_CANDIDATES):
            used = blocks.used_in(page)
            # a used block is a tree node's or a request's private one; only a node being
            # copied between tiers cannot move
            if all(b not in by_block or not by_block[b].moving for b in used):
                self._move_out(page, used, self._private(set(used) - by_block.keys()))
                return page
        return None

    def _private(self, wanted: set[int]) -> dict[int, tuple[SeqCache, int]]:
        """Who holds each of the private blocks ``wanted``: (request, index in its block table)."""
        out: dict[int, tuple[SeqCache, int]] = {}
        if wanted:
            for seq in self.active():
                for i in range(len(seq.nodes), len(seq.block_table)):
                    if seq.block_table[i] in wanted:
                        out[seq.block_table[i]] = (seq, i)
        assert len(out) == len(wanted), "a used block held by neither a node nor a request"
        return out

    def _move_out(self, page: int, used: list[int], private: dict[int, tuple[SeqCache, int]]) -> None:
        """Move ``used`` (every used block of ``page``: tree nodes' and requests' private ones)
        into free blocks of other pages, block tables included; the page leaves the pool."""
        blocks, n = self.blocks, self.blocks.page_blocks
        for b in blocks.free_in(page):  # keep the destinations off this page
            blocks.take(b)
        for src in used:
            dst = blocks.allocate()
            self.moves.append((src, dst))
            self._repoint(src, dst, private)
        for b in range(page * n, page * n + n):
            blocks.free(b)
        blocks.remove_page(page)
        self.counters["kv.moved_blocks"] += len(used)

    def undo_moves(self, moves: list[tuple[int, int]]) -> None:
        """A step failed before its copies ran: every moved block goes back to its source (whose
        bytes are untouched: the page it vacated was written by nothing), block tables included,
        and the vacated pages are KV pages again. Their checkpoint slots were the failed step's
        captures (released by the caller) or a tracking slot of one of its requests (given up)."""
        assert self.ckpts is not None
        ckpts, blocks = self.ckpts, self.blocks
        for page in sorted({src // blocks.page_blocks for src, _ in moves}):
            if ckpts.slots.ckpt_state[page] is SlotState.TRACKING:
                seq = ckpts.trackers[page]
                ckpts.untrack(seq, finished=False)
                seq.tracking_boundary = seq.pending_tracking_boundary = 0
                ckpts.slots.free_checkpoint(page)
            ckpts.slots.remove_free_checkpoint_slot(page)
            self.arena.convert(page, PageUse.KV)
            blocks.add_page(page)
        private = self._private({dst for _, dst in moves} - self.tree.by_block.keys())
        for src, dst in moves:
            blocks.take(src)
            self._repoint(dst, src, private)
            blocks.free(dst)

    def _repoint(self, old: int, new: int, private: dict[int, tuple[SeqCache, int]]) -> None:
        """Whoever holds block ``old`` (a request's private block, or a tree node and the
        requests pinning it) holds ``new`` instead."""
        if old in private:
            seq, i = private[old]
            seq.block_table[i] = new
            return
        node = self.tree.by_block[old]
        self.tree.move(node, new)
        if node.ref_count:  # pinned: the requests on its path address it by block id
            i = node.depth - 1
            for seq in self.active():
                if len(seq.nodes) > i and seq.nodes[i] is node:
                    seq.block_table[i] = new

    def take_moves(self) -> list[tuple[int, int]]:
        """The copies planned since the last call, settled: a block moved twice is copied once
        from where its bytes are, and a moved node evicted since needs no copy. No source is
        another move's destination, so the copies may run in any order (or all at once)."""
        origin: dict[int, int] = {}  # destination -> the block its bytes are in now
        for src, dst in self.moves:
            origin[dst] = origin.pop(src, src)
        self.moves = []
        return [(src, dst) for dst, src in origin.items() if not self.blocks.is_free(dst)]

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
            "cache.checkpoint_floor": self.floor,
        }

    def check_integrity(self) -> None:
        assert self.ckpts is not None
        self.blocks.check_integrity()
        self.arena.check_integrity(self.blocks.pages, set(self.ckpts.slots.ckpt_state))
        device = {n.block_id: n for n in self.tree.nodes() if n.block_id >= 0}
        assert device == self.tree.by_block, "block -> node map drift"
