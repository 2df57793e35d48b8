"""The host tier: KV blocks and checkpoints demoted from the device instead of dropped.

The host's memory is either two fixed pools, each optional (size 0 = off): KV blocks
(``cache.host_kv_cache_bytes``) and checkpoint slots (``cache.host_checkpoint_pool_bytes``),
in their own id spaces; or one byte budget of *pages* (``num_pages``), each the size of one
checkpoint and each exactly one of FREE, KV (``page_blocks`` = ceil(checkpoint bytes / KV
block bytes) host blocks, ids ``page * page_blocks ...``) or CHECKPOINT (host slot id = the
page), so KV and checkpoints trade bytes by value (``HostPages``, ``cache/host_pages.py``).
A KV page turns back into a free page only when wholly free. When a checkpoint needs a page
and the KV pages' free blocks add up to one, the emptiest KV page whose nodes can move is
vacated first: its blocks move into free blocks of the other KV pages (host copies,
``KV_MOVE``, planned with the saves and run before them). An eviction frees a whole
conversation's blocks where one was wanted, so its scattered remainder would otherwise wait
for KV while checkpoints evict live items (long reuse at 2.5 + 10 GiB: about 570 such
blocks, 3 % of the host, docs/cache.md). Else the victim is the weakest host checkpoint or
the KV page whose blocks are worth least: its nodes go (with the host nodes below them).
The radix tree records each item's tier (``cache/radix_tree.py``). This part owns the host
pools, plans the *saves* (device -> host copies) of what the device tier gives up, and
evicts on the host. Loads (host -> device) are the cache manager's: they belong to the
request whose hit needs them.

Policy (write-back on eviction). Writing every computed block through to the host would
copy each block once whether or not it is ever evicted; copying on eviction moves only
what the device gives up, and a tree node lives in exactly one tier, so the host holds
what the device does not (an exclusive cache: host bytes add to device bytes).

* A device KV leaf being evicted is demoted when it is worth keeping — it holds a
  checkpoint (either tier) or has host nodes below it (without it they are unreachable);
  a checkpoint-less leaf with nothing below can never end a hit and is dropped.
* A device checkpoint being evicted is demoted when the host has room, or unless the host's
  weakest item stands higher (``worth``: with one budget under a per-byte value strategy,
  the bands of ``cache/host_order.py`` — dominated, dead, alive — and a tie goes to the
  newcomer, so live items turn over like LRU; else the strategy's own worth, ties to the
  residents); else dropped.
* The host evicts its own: checkpoint-less leaves first (no hit can end there), then the
  least valuable of the LRU leaf (valued as its checkpoint) and the weakest checkpoint.
  A host checkpoint evicted takes with it the host KV only it made servable (host leaves
  upwards to the nearest checkpoint or fork), so the host's bytes hold whole servable paths.
  A full host tier means *drop*, never an error.

Every demoted item is ``moving`` until its save has landed: a match does not use it, so a
failed save only drops the item (and the host nodes below it), never a request. Torch-free.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from deltaserve.cache.arena import blocks_per_page
from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.disk_link import DiskLink
from deltaserve.cache.eviction import CheckpointEviction
from deltaserve.cache.host_order import ALIVE, LruCheckpoints, band
from deltaserve.cache.host_pages import CHECKPOINT, FREE, KV, HostPages
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.types import SeqCache, Tier, Transfer, TransferKind

#: partly used KV pages looked at per vacate (the fewest blocks held first)
VACATE_CANDIDATES = 8
_KV_TO_HOST = (TransferKind.KV_SAVE, TransferKind.KV_MOVE)  # the host saves that write KV


class HostTier:
    def __init__(
        self,
        tree: RadixTree,
        eviction: CheckpointEviction,
        *,
        num_blocks: int,
        num_slots: int,
        kv_block_bytes: int,
        checkpoint_bytes: int,
        num_pages: int = 0,
        page_blocks: int = 0,  # host blocks per page (0: checkpoint bytes over KV block bytes, rounded up)
        disk: DiskLink | None = None,
    ) -> None:
        self.tree = tree
        self.eviction = eviction  # its ``worth`` ranks host checkpoints; lower goes first
        self.kv_block_bytes = kv_block_bytes
        self.checkpoint_bytes = checkpoint_bytes
        self.pages: HostPages | None = None
        self.blocks: BlockPool | None = None
        if num_pages > 0:  # one budget: the fixed pair is not used
            page_blocks = page_blocks or blocks_per_page(checkpoint_bytes, kv_block_bytes)
            self.pages = HostPages(num_pages, page_blocks)
            num_slots = num_pages if checkpoint_bytes > 0 else 0
        elif num_blocks > 0:
            self.blocks = BlockPool(num_blocks)
        eviction.displace_to_host = self.pages is not None
        self.num_slots = num_slots
        self._free_slots: deque[int] = deque(range(num_slots) if self.pages is None else ())
        self.attached: dict[int, Node] = {}  # host slot -> node holding it
        # ``attached``'s nodes, kept with it (``_weakest_checkpoint``); one budget under a
        # per-byte strategy ranks live checkpoints by recency shifted by size
        page_blocks = self.pages.page_blocks if self.pages is not None and eviction.per_byte else None
        self.lru = LruCheckpoints(tree, page_blocks)
        self.owner: dict[int, Node] = {}  # host block -> node holding it
        self.saves: list[Transfer] = []  # planned, not yet handed to a step plan
        # the disk tier (``cache/disk_link.py``) hears of a host checkpoint evicted (its bytes
        # intact until the next step's copies) before it goes
        self.disk = disk if disk is not None else DiskLink()
        self.counters: dict[str, int] = dict.fromkeys(
            ("host.kv_demoted_blocks", "host.kv_evicted_blocks", "host.checkpoints_demoted",
             "host.checkpoints_evicted", "host.checkpoints_refused", "host.bytes_saved",
             "host.failed_saves", "host.kv_moved_blocks"), 0)  # fmt: skip

    @property
    def kv_enabled(self) -> bool:
        return self.blocks is not None or self.pages is not None

    @property
    def enabled(self) -> bool:
        return self.kv_enabled or self.num_slots > 0

    def nbytes(self, kind: TransferKind) -> int:
        return self.kv_block_bytes if kind.is_kv else self.checkpoint_bytes

    # ------------------------------------------------------------------ space
    def _has_slot(self) -> bool:
        return bool(self.pages.free_pages) if self.pages is not None else bool(self._free_slots)

    def _take(self) -> int:
        return self.pages.allocate_slot() if self.pages is not None else self._free_slots.popleft()

    def _give_back_slot(self, slot: int) -> None:
        if self.pages is not None:
            self.pages.free_slot(slot)
        else:
            self._free_slots.append(slot)

    def _has_block(self) -> bool:
        if self.pages is not None:
            return self.pages.can_allocate_block()
        return self.blocks is not None and self.blocks.num_free > 0

    def _allocate_block(self, node: Node, avoid: int = -1) -> int:
        """A host block for ``node`` (one budget: not on page ``avoid``)."""
        block = self.pages.allocate_block(avoid) if self.pages is not None else self.blocks.allocate()  # type: ignore[union-attr]
        self.owner[block] = node
        return block

    def _page_nodes(self, page: int) -> list[Node]:
        """The nodes holding blocks of KV page ``page``."""
        n = self.pages.page_blocks  # type: ignore[union-attr]
        return [self.owner[b] for b in range(page * n, page * n + n) if b in self.owner]

    def _free_block(self, block: int) -> None:
        del self.owner[block]
        if self.pages is not None:
            self.pages.free_block(block)
        else:
            assert self.blocks is not None
            self.blocks.free(block)

    # ------------------------------------------------------------------ values
    def _evictable_checkpoint(self, n: Node) -> bool:
        return not n.ckpt_pins and not n.ckpt_moving

    def worth(self, node: Node) -> float:
        """Where ``node``'s host checkpoint stands in the host's order (lower goes first). One
        budget of pages under a per-byte value strategy: its band (``cache/host_order.py``:
        dominated, dead or alive; recency decides within one). Otherwise the strategy's own
        worth: with the fixed pair the host's KV and checkpoint bytes are not traded, and a
        worth that is not per byte (``v1``: a recency) is an order already."""
        if self.pages is None or not self.eviction.per_byte:
            return self.eviction.worth(node)
        return band(node, self.eviction, self.tree)

    def _weakest_checkpoint(self) -> tuple[Node | None, float]:
        """The host checkpoint worth least, and its worth (one budget under a per-byte value
        strategy: the lowest band, least recently used first, scanned in LRU order)."""
        worth = self.worth
        if self.pages is not None and self.eviction.per_byte:
            return self.lru.weakest(worth, self._evictable_checkpoint)
        best: Node | None = None
        key = (math.inf, 0)
        for n in self.attached.values():
            if self._evictable_checkpoint(n):
                # ties: the least recently used with one budget; the first held with the pair
                k = (worth(n), n.last_access if self.pages is not None else 0)
                if k < key:
                    best, key = n, k
        return best, key[0]

    def _page_victim(self, enough: float = math.inf) -> tuple[list[Node], float]:
        """The KV page to free for a checkpoint, and what it is worth: the page of the host
        KV leaf next in line (checkpoint-less first, then LRU: pages fill in demotion order,
        so its blocks are about as old), worth the most valuable host checkpoint its nodes
        and the host nodes below them hold (a hit there needs every block of its path).
        ``([], inf)`` when no page can go: a block of it is being copied, or a checkpoint
        below it is pinned. The walk stops once the worth reaches ``enough`` (then a page that
        cannot go may read as worth it: for callers to whom both mean "not weaker")."""
        pages = self.pages
        leaf = self.tree.peek_host_leaf()
        if pages is None or leaf is None:
            return [], math.inf
        nodes = self._page_nodes(pages.page_of(leaf.host_block))
        worth = 0.0
        stack = list(nodes)
        while stack:
            node = stack.pop()
            if node.moving or node.block_id >= 0 or node.ckpt_pins or node.ckpt_moving:
                return [], math.inf
            if node.host_slot is not None and (worth := max(worth, self.worth(node))) >= enough:
                return nodes, worth
            stack.extend(node.children.values())
        return nodes, worth

    def floor(self) -> float:
        """The worth a demoted checkpoint must reach to be kept on the host (0: there is room,
        or a KV page can be vacated for it; -1: only worthless items would go; inf: no host
        checkpoints, or nothing can go)."""
        if self.num_slots == 0:
            return math.inf
        if self._has_slot() or self._vacatable() is not None:
            return 0.0
        _, worth = self._weakest_checkpoint()
        if self.pages is not None:
            if self.eviction.per_byte:
                # the bands are not on the strategy's scale: a capture may push a checkpoint
                # down where the host holds something dead or dominated, not past live items.
                # A page is worth >= 0 (DEAD), so only past a live weakest checkpoint can it
                # be lower, and then only whether it is < ALIVE matters
                worth = worth if worth < ALIVE else min(worth, self._page_victim(ALIVE)[1])
                return worth if worth < ALIVE else math.inf
            worth = min(worth, self._page_victim()[1])
        return worth

    # ------------------------------------------------------------------ demotion (saves)
    def demote_checkpoint(self, node: Node, device_slot: int) -> bool:
        """``node``'s device checkpoint (already detached from ``device_slot``, which the
        caller frees) goes to the host if there is room or a worse item can go. True if
        kept on the host (a host copy it already had counts)."""
        if node.host_slot is not None:
            return True
        if self.num_slots == 0:
            return False
        slot = self._take_slot(self.worth(node))
        if slot < 0:
            self.counters["host.checkpoints_refused"] += 1
            return False
        node.host_slot = slot
        self.tree.checkpoint_changed(node)
        self.attached[slot] = node
        self.lru.add(node)
        self.tree.set_ckpt_moving(node, True)
        self.saves.append(Transfer(TransferKind.CKPT_SAVE, node, device_slot, slot))
        self.counters["host.checkpoints_demoted"] += 1
        return True

    def _take_slot(self, worth: float) -> int:
        """A host slot for a checkpoint worth ``worth``: a free one, else the place of the
        weakest item if that is not worth more (a checkpoint, or a KV page's nodes); -1."""
        while not self._has_slot():
            if self._vacate_kv_page():
                continue
            victim, victim_worth = self._weakest_checkpoint()
            nodes, page_worth = self._victim_page(victim, victim_worth)
            weakest = min(victim_worth, page_worth)
            # one budget: a tie goes to the newcomer (items the value model cannot tell apart
            # turn over like LRU); the fixed pair keeps its residents on a tie
            if weakest > worth or (self.pages is None and weakest >= worth) or (victim is None and not nodes):
                return -1
            if victim is not None and victim_worth <= page_worth:
                self._evict_checkpoints([victim])
                self.drop_checkpoint(victim)
                self._trim(victim)  # its path's KV cannot serve without it
            else:
                self._evict_checkpoints(nodes, below=True)
                self._drop_nodes(nodes)
        return self._take()

    def _vacatable(self) -> tuple[int, list[Node]] | None:
        """The emptiest KV page whose nodes can move (on the host only, no copy of theirs
        pending) into free blocks of the other KV pages, and its nodes; None when none can.
        Any open page's blocks fit in the others' free blocks exactly when all the open
        pages' free blocks add up to a page (used + the others' free = free in all - n + used)."""
        pages = self.pages
        if pages is None or pages.open_free < pages.page_blocks:
            return None
        for page in pages.emptiest_open(VACATE_CANDIDATES):
            nodes = self._page_nodes(page)
            if not any(node.moving or node.block_id >= 0 for node in nodes):
                return page, nodes
        return None

    def _vacate_kv_page(self) -> bool:
        """Free a page by moving the blocks of a ``_vacatable`` page; False when none is."""
        found = self._vacatable()
        if found is None:
            return False
        page, nodes = found
        for node in nodes:
            old, node.host_block = node.host_block, self._allocate_block(node, avoid=page)
            self._free_block(old)
            self.tree.set_moving(node, True)  # not matched (nor written to disk) meanwhile
            self.saves.append(Transfer(TransferKind.KV_MOVE, node, old, node.host_block))
        self.counters["host.kv_moved_blocks"] += len(nodes)
        return True

    def _victim_page(self, victim: Node | None, victim_worth: float) -> tuple[list[Node], float]:
        """``_page_victim`` as far as ``_take_slot`` needs it beside ``victim``: under the bands a
        page (worth >= DEAD) never goes before a dominated or dead checkpoint, and past a live
        one only a page worth less than ALIVE does (a tie keeps the checkpoint the victim)."""
        if self.pages is None or (self.eviction.per_byte and victim is not None and victim_worth < ALIVE):
            return [], math.inf
        return self._page_victim(ALIVE if self.eviction.per_byte and victim is not None else math.inf)

    def _drop_nodes(self, nodes: list[Node]) -> None:
        """Drop host nodes with every host node below them, deepest first."""
        for n in sorted(nodes, key=lambda n: -n.depth):
            if n.parent is not None:  # (not already gone below another one)
                self.drop_below(n)
                self.remove(n)

    def drop_checkpoint(self, node: Node) -> None:
        """Evict ``node``'s host checkpoint (not pinned)."""
        slot = node.host_slot
        assert slot is not None and not node.ckpt_pins, f"drop of a pinned or absent host checkpoint: {node}"
        if node.ckpt_moving:  # its save never ran: forget it
            self.saves = [t for t in self.saves if not (t.node is node and t.kind is TransferKind.CKPT_SAVE)]
        node.host_slot = None
        self.tree.checkpoint_changed(node)
        node.ckpt_moving = False
        if self.tree.on_checkpoint_gone is not None:
            self.tree.on_checkpoint_gone(node.key)
        del self.attached[slot]
        self.lru.discard(node)
        self._give_back_slot(slot)
        self.tree.version += 1
        self.tree.refresh(node)
        self.counters["host.checkpoints_evicted"] += 1

    def demote_kv(self, node: Node) -> int | None:
        """Move a device leaf's KV block to the host; the device block it held (for the
        caller to free), or None when the host has no room (then it must be dropped)."""
        if not self.kv_enabled:
            return None
        while not self._has_block():
            if not self._evict_for_kv():
                return None
        device_block = self.tree.demote(node, self._allocate_block(node))
        self.saves.append(Transfer(TransferKind.KV_SAVE, node, device_block, node.host_block))
        self.counters["host.kv_demoted_blocks"] += 1
        return device_block

    # ------------------------------------------------------------------ host eviction
    def _evict_for_kv(self) -> bool:
        """Make room for one host block: a checkpoint-less leaf goes first (no hit ends
        there); with one budget, else the weaker of the LRU leaf (worth its checkpoint,
        which goes with it) and the weakest checkpoint (its page turns KV)."""
        leaf = self.tree.peek_host_leaf()
        if self.pages is not None and (leaf is None or leaf.host_slot is not None):
            victim, worth = self._weakest_checkpoint()
            if victim is not None and (
                leaf is None
                or (worth, self.lru.rank(victim, worth))
                <= (leaf_worth := self.worth(leaf), self.lru.rank(leaf, leaf_worth))
            ):
                self._evict_checkpoints([victim])
                self.drop_checkpoint(victim)
                self._trim(victim)  # its path's KV cannot serve without it
                return True
        if leaf is None:
            return False
        self._evict_checkpoints([leaf])
        self.remove(leaf)
        return True

    def _trim(self, node: Node) -> None:
        """``node``'s host checkpoint was evicted: the host KV only it made servable goes with
        it, leaf upwards while a node is a host leaf with no checkpoint (up to the nearest
        checkpoint, fork, device node or pinned node). Such KV can never end a hybrid hit;
        left in place it would hold its pages until KV next needs room, while checkpoints
        that need a whole page evict live ones instead."""
        tree = self.tree
        while node.parent is not None and node.host_slot is None and tree.is_host_leaf(node):
            parent = node.parent
            self.remove(node)
            node = parent

    def evict_leaf(self) -> bool:
        node = self.tree.peek_host_leaf()
        if node is None:
            return False
        self._evict_checkpoints([node])
        self.remove(node)
        return True

    def _evict_checkpoints(self, nodes: list[Node], *, below: bool = False) -> None:
        """The host checkpoints of ``nodes`` (and, with ``below``, of the host nodes under
        them) are being evicted: the disk tier's hook sees each first."""
        disk = self.disk
        if disk.tier is None:
            return
        stack = list(nodes)
        while stack:
            n = stack.pop()
            if n.host_slot is not None and not n.ckpt_moving:
                disk.write_back(n, Tier.HOST, n.host_slot)
            if below:
                stack.extend(n.children.values())

    def remove(self, node: Node) -> None:
        """Drop a host node with no children (and its host checkpoint) from the tree."""
        if node.host_slot is not None:
            self.drop_checkpoint(node)
        if node.moving:  # its save never ran: forget it
            self.saves = [t for t in self.saves if not (t.node is node and t.kind in _KV_TO_HOST)]
            node.moving = False
        self._free_block(node.host_block)
        node.host_block = -1
        self.tree.remove_leaf(node)
        self.counters["host.kv_evicted_blocks"] += 1

    def drop_below(self, node: Node) -> None:
        """Drop every (host) node below ``node``, deepest first."""
        stack = list(node.children.values())
        order: list[Node] = []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):
            assert n.block_id < 0 and not n.ref_count, (
                f"{n} below a dropped node is not an unpinned host node"
            )
            self.remove(n)

    def release_block(self, node: Node) -> None:
        """``node``'s KV is on the device again: its host block goes back to the pool."""
        self._free_block(node.host_block)
        node.host_block = -1

    # ------------------------------------------------------------------ landing
    def _current(self, t: Transfer) -> bool:
        """The save's item is still there (a failed save may have dropped a node with its
        other pending save)."""
        if t.kind in _KV_TO_HOST:
            return t.node.parent is not None and t.node.host_block == t.dst
        return t.node.host_slot == t.dst

    def save_landed(self, t: Transfer) -> None:
        if not self._current(t):
            return
        if t.kind in _KV_TO_HOST:
            self.tree.set_moving(t.node, False)
        else:
            self.tree.set_ckpt_moving(t.node, False)
        if t.kind is not TransferKind.KV_MOVE:  # (a move within the host crosses no link)
            self.counters["host.bytes_saved"] += self.nbytes(t.kind)

    def save_failed(self, t: Transfer) -> None:
        """The copy did not happen: the host item holds nothing; it is dropped (a KV node
        with the host nodes below it: they are unreachable without it)."""
        self.counters["host.failed_saves"] += 1
        if not self._current(t):
            return
        if t.kind is TransferKind.CKPT_SAVE:
            self.drop_checkpoint(t.node)
            return
        t.node.moving = False
        self.drop_below(t.node)
        self.remove(t.node)

    # ------------------------------------------------------------------ reporting
    def usage(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        if self.pages is not None:
            counts = self.pages.counts()
            out["host.pages"] = self.pages.num_pages
            out["host.kv_pages"] = counts[KV]
            out["host.checkpoint_pages"] = counts[CHECKPOINT]
            out["host.free_pages"] = counts[FREE]
        if self.kv_enabled:
            out["host.kv_blocks"] = (
                self.pages.num_blocks if self.pages is not None else self.blocks.num_blocks
            )  # type: ignore[union-attr]
            out["host.kv_used_blocks"] = len(self.owner)
        if self.num_slots:
            out["host.checkpoint_slots"] = self.num_slots
            out["host.checkpoint_used_slots"] = len(self.attached)
        return out

    # ------------------------------------------------------------------ invariants
    def check_integrity(
        self, nodes: list[Node], active: Iterable[SeqCache], inflight_saves: list[Transfer]
    ) -> None:
        """Both tiers: every host block / slot free or held by one node; device nodes form
        the top of the tree; pinned nodes are on the device; every moving item has exactly
        one pending copy."""
        self._check_tiers(nodes)
        self._check_moving(nodes, self.saves + inflight_saves + [t for seq in active for t in seq.loads])
        self._check_host_blocks(nodes)
        self._check_host_slots(nodes)
        self.lru.check()

    def _check_tiers(self, nodes: list[Node]) -> None:
        """Device nodes form the top of the tree; a host node holds a host block, no pin
        and no device checkpoint."""
        root = self.tree.root
        for n in nodes:
            parent = n.parent
            assert parent is not None
            assert n.device_children == sum(1 for c in n.children.values() if c.block_id >= 0), (
                f"{n}: device_children drift"
            )
            if n.block_id >= 0:
                assert parent is root or parent.block_id >= 0, f"{n} on the device below a host node"
                assert n.host_block < 0 or n.moving, f"{n} in both tiers but not being loaded"
            else:
                assert n.host_block >= 0, f"{n} holds KV in no tier"
                assert not n.ref_count, f"{n} pinned on the host"
                assert n.checkpoint_slot is None, f"{n}: device checkpoint on a host node"

    @staticmethod
    def _check_moving(nodes: list[Node], pending: list[Transfer]) -> None:
        """A node's ``moving`` / ``ckpt_moving`` flag is set exactly when a copy of its KV /
        host checkpoint is pending, and a KV block has at most one."""
        moving = {id(t.node) for t in pending if t.kind.is_kv}
        ckpt_moving = {id(t.node) for t in pending if t.kind is TransferKind.CKPT_SAVE}
        assert len(moving) == sum(1 for t in pending if t.kind.is_kv), "two copies of one KV block pending"
        for n in nodes:
            assert n.moving == (id(n) in moving), f"{n}: moving flag != pending copies"
            assert n.ckpt_moving == (id(n) in ckpt_moving), f"{n}: ckpt_moving flag != pending copies"

    def _check_host_blocks(self, nodes: list[Node]) -> None:
        """Every host KV block is free or held by exactly one node (and the owner map agrees);
        with one budget, every page is exactly one of free / KV / checkpoint."""
        owner: dict[int, Node] = {}
        for n in nodes:
            if n.host_block < 0:
                continue
            assert n.host_block not in owner, f"host block {n.host_block} on two nodes"
            owner[n.host_block] = n
        assert owner == self.owner, "host block owner map drift"
        if self.pages is not None:
            self.pages.check(owner, {n.host_slot: n for n in nodes if n.host_slot is not None})
            return
        if self.blocks is None:
            assert not owner, "host blocks without a host KV pool"
            return
        assert all(0 <= b < self.blocks.num_blocks for b in owner), "host block out of range"
        free = self.blocks.free_ids()
        assert len(set(free)) == len(free) and not set(free) & set(owner), "host block both free and held"
        assert len(free) + len(owner) == self.blocks.num_blocks, "host KV blocks leaked"

    def _check_host_slots(self, nodes: list[Node]) -> None:
        """Every host checkpoint slot is free or held by exactly one node."""
        slots: dict[int, Node] = {}
        for n in nodes:
            if n.host_slot is not None:
                assert n.host_slot not in slots, f"host slot {n.host_slot} on two nodes"
                slots[n.host_slot] = n
        assert slots == self.attached, "host slot map drift"
        if self.pages is not None:  # a slot is a page: ``HostPages.check`` accounts for it
            assert all(0 <= s < self.num_slots for s in slots), "host slot out of range"
            return
        assert len(self._free_slots) + len(slots) == self.num_slots, "host checkpoint slots leaked"
        assert not set(self._free_slots) & set(slots), "host slot both free and held"
