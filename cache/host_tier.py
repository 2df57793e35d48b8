"""The host tier: KV blocks and checkpoints demoted from the device instead of dropped.

Two host pools, each optional (size 0 = off): KV blocks (``cache.host_kv_cache_bytes``)
and checkpoint slots (``cache.host_checkpoint_pool_bytes``), in their own id spaces. The
radix tree records each item's tier (``cache/radix_tree.py``). This part owns the host
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
* A device checkpoint being evicted is demoted when a host slot is free or the weakest
  host checkpoint is worth less (the device tier's eviction strategy: ``worth``); else dropped.
* The host evicts its own: checkpoint-less leaves first, then LRU; checkpoints by value.
  A full host tier means *drop*, never an error.

Every demoted item is ``moving`` until its save has landed: a match does not use it, so a
failed save only drops the item (and the host nodes below it), never a request. Torch-free.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.eviction import CheckpointEviction
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.types import SeqCache, Transfer, TransferKind


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
    ) -> None:
        self.tree = tree
        self.eviction = eviction  # its ``worth`` ranks host checkpoints; lower goes first
        self.blocks = BlockPool(num_blocks) if num_blocks > 0 else None
        self.num_slots = num_slots
        self._free_slots: deque[int] = deque(range(num_slots))
        self.attached: dict[int, Node] = {}  # host slot -> node holding it
        self.saves: list[Transfer] = []  # planned, not yet handed to a step plan
        self.kv_block_bytes = kv_block_bytes
        self.checkpoint_bytes = checkpoint_bytes
        self.counters: dict[str, int] = dict.fromkeys(
            ("host.kv_demoted_blocks", "host.kv_evicted_blocks", "host.checkpoints_demoted",
             "host.checkpoints_evicted", "host.bytes_saved", "host.failed_saves"), 0)  # fmt: skip

    @property
    def kv_enabled(self) -> bool:
        return self.blocks is not None

    @property
    def enabled(self) -> bool:
        return self.blocks is not None or self.num_slots > 0

    def nbytes(self, kind: TransferKind) -> int:
        return self.kv_block_bytes if kind.is_kv else self.checkpoint_bytes

    # ------------------------------------------------------------------ demotion (saves)
    def demote_checkpoint(self, node: Node, device_slot: int) -> bool:
        """``node``'s device checkpoint (already detached from ``device_slot``, which the
        caller frees) goes to the host if a slot is free or a worse one can go. True if
        kept on the host (a host copy it already had counts)."""
        if node.host_slot is not None:
            return True
        if self.num_slots == 0:
            return False
        slot = self._take_slot(self.eviction.worth(node))
        if slot < 0:
            return False
        node.host_slot = slot
        self.attached[slot] = node
        self.tree.set_ckpt_moving(node, True)
        self.saves.append(Transfer(TransferKind.CKPT_SAVE, node, device_slot, slot))
        self.counters["host.checkpoints_demoted"] += 1
        return True

    def floor(self) -> float:
        """The worth a demoted checkpoint must beat to be kept on the host (0: a slot is
        free; inf: no host checkpoints, or none can go)."""
        if self.num_slots == 0:
            return math.inf
        if self._free_slots:
            return 0.0
        return min(
            (self.eviction.worth(n) for n in self.attached.values() if not n.ckpt_pins and not n.ckpt_moving),
            default=math.inf,
        )

    def _take_slot(self, worth: float) -> int:
        if not self._free_slots:
            victim = min(
                (n for n in self.attached.values() if not n.ckpt_pins and not n.ckpt_moving),
                key=self.eviction.worth,
                default=None,
            )
            if victim is None or self.eviction.worth(victim) >= worth:
                return -1
            self.drop_checkpoint(victim)
        return self._free_slots.popleft()

    def drop_checkpoint(self, node: Node) -> None:
        """Evict ``node``'s host checkpoint (not pinned)."""
        slot = node.host_slot
        assert slot is not None and not node.ckpt_pins, f"drop of a pinned or absent host checkpoint: {node}"
        if node.ckpt_moving:  # its save never ran: forget it
            self.saves = [t for t in self.saves if not (t.node is node and t.kind is TransferKind.CKPT_SAVE)]
        node.host_slot = None
        node.ckpt_moving = False
        del self.attached[slot]
        self._free_slots.append(slot)
        self.tree.version += 1
        self.tree.refresh(node)
        self.counters["host.checkpoints_evicted"] += 1

    def demote_kv(self, node: Node) -> int | None:
        """Move a device leaf's KV block to the host; the device block it held (for the
        caller to free), or None when the host has no room (then it must be dropped)."""
        if self.blocks is None:
            return None
        while self.blocks.num_free == 0:
            if not self.evict_leaf():
                return None
        device_block = self.tree.demote(node, self.blocks.allocate())
        self.saves.append(Transfer(TransferKind.KV_SAVE, node, device_block, node.host_block))
        self.counters["host.kv_demoted_blocks"] += 1
        return device_block

    # ------------------------------------------------------------------ host eviction
    def evict_leaf(self) -> bool:
        node = self.tree.peek_host_leaf()
        if node is None:
            return False
        self.remove(node)
        return True

    def remove(self, node: Node) -> None:
        """Drop a host node with no children (and its host checkpoint) from the tree."""
        if node.host_slot is not None:
            self.drop_checkpoint(node)
        if node.moving:  # its save never ran: forget it
            self.saves = [t for t in self.saves if not (t.node is node and t.kind is TransferKind.KV_SAVE)]
            node.moving = False
        assert self.blocks is not None
        self.blocks.free(node.host_block)
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
        assert self.blocks is not None
        self.blocks.free(node.host_block)
        node.host_block = -1

    # ------------------------------------------------------------------ landing
    def _current(self, t: Transfer) -> bool:
        """The save's item is still there (a failed save may have dropped a node with its
        other pending save)."""
        if t.kind is TransferKind.KV_SAVE:
            return t.node.parent is not None and t.node.host_block == t.dst
        return t.node.host_slot == t.dst

    def save_landed(self, t: Transfer) -> None:
        if not self._current(t):
            return
        if t.kind is TransferKind.KV_SAVE:
            self.tree.set_moving(t.node, False)
        else:
            self.tree.set_ckpt_moving(t.node, False)
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
        if self.blocks is not None:
            out["host.kv_blocks"] = self.blocks.num_blocks
            out["host.kv_used_blocks"] = self.blocks.num_blocks - self.blocks.num_free
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
        """Every host KV block is free or held by exactly one node."""
        owner: dict[int, Node] = {}
        for n in nodes:
            if n.host_block < 0:
                continue
            assert self.blocks is not None and 0 <= n.host_block < self.blocks.num_blocks
            assert n.host_block not in owner, f"host block {n.host_block} on two nodes"
            owner[n.host_block] = n
        if self.blocks is None:
            assert not owner, "host blocks without a host KV pool"
            return
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
        assert len(self._free_slots) + len(slots) == self.num_slots, "host checkpoint slots leaked"
        assert not set(self._free_slots) & set(slots), "host slot both free and held"
