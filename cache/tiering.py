"""Tiering: how cached items move between the device, the host tier and the disk tier.

Down (eviction): a device KV leaf that is worth keeping (a checkpoint ends a hit on it, or
host nodes hang below it) is *demoted* to the host when the host has room (a save, run at
the start of the next step); else, with a disk tier, its checkpoint is written back to disk
(``cache/disk_link.py``), and it is dropped with everything below it.

Up (admission): a hit's host KV blocks are *promoted* into device blocks with a load queued
on the request (``cache/load_queue.py`` stages and lands them); a host checkpoint is loaded
straight into the request's live slot; a disk hit beyond the tree's is loaded into private
blocks and the live slot. Making room for a promotion pins the hit's path meanwhile, so
the eviction it causes never takes the hit itself.

Per step: ``plan_transfers`` hands the step's plan every copy due (host saves, the one
budget's page moves, staged loads, disk writes); ``check_integrity`` proves the host tier's
and the loads' accounting. Torch-free.

Invariant: a load is queued on exactly the request that needs it, and a staged one sits in
exactly one of the load queue or the unlanded in-flight plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve.cache.block_pool import BlockPool, PagedBlockPool
from deltaserve.cache.checkpoint_store import CheckpointStore
from deltaserve.cache.disk_link import DiskLink
from deltaserve.cache.disk_tier import DiskFetch
from deltaserve.cache.eviction import CheckpointEviction
from deltaserve.cache.host_tier import HostTier
from deltaserve.cache.load_queue import LoadQueue
from deltaserve.cache.prefix_index import PrefixIndex
from deltaserve.cache.radix_tree import Node
from deltaserve.cache.shared_budget import SharedBudget
from deltaserve.cache.types import SeqCache, StepPlan, Tier, Transfer, TransferKind


class Tiering:
    def __init__(
        self,
        kv: PrefixIndex,
        ckpts: CheckpointStore,
        host: HostTier,
        disk: DiskLink,
        load_queue: LoadQueue,
        eviction: CheckpointEviction,
        budget: SharedBudget | None,
        active: dict[str, SeqCache],
        *,
        has_gdn: bool,
    ) -> None:
        self.kv, self.ckpts, self.host, self.disk = kv, ckpts, host, disk
        self.tree = kv.tree
        self.blocks: BlockPool | PagedBlockPool = kv.blocks
        self.block_size = kv.block_size
        self.load_queue, self.eviction, self.budget = load_queue, eviction, budget
        self.active = active  # the manager's admitted requests (the same dict)
        self.has_gdn = has_gdn
        self.counters: dict[str, int] = {"kv.evicted_blocks": 0}

    # ------------------------------------------------------------------ down
    def free_one_block(self, admission: bool = False) -> bool:
        """Free at least one device block (shared budget: ``SharedBudget.free_block``; it may
        keep checkpoints back from KV while another request could give way instead)."""
        if self.budget is not None:
            return self.budget.free_block(force=len(self.active) <= 1, admission=admission)
        node = self.eviction.kv_victim(self.ckpts.residents)
        if node is None:
            return False
        self.evict_leaf(node)
        return True

    def evict_leaf(self, node: Node) -> None:
        """Free ``node``'s device block: the leaf is demoted to the host when it is worth
        keeping (a checkpoint, or host nodes below it) and the host has room, else dropped
        with everything below it."""
        self.counters["kv.evicted_blocks"] += 1
        # without GDN layers every block ends a hit; with them only a checkpoint does
        keeps = (
            not self.has_gdn
            or node.children
            or node.checkpoint_slot is not None
            or node.host_slot is not None
        )
        device_block = self.host.demote_kv(node) if keeps else None
        if device_block is not None:
            if node.checkpoint_slot is not None:  # it follows its KV to the host (or goes)
                self.ckpts.evict(node)
            self.blocks.free(device_block)
            return
        disk = self.disk.tier
        if disk is not None:  # the last tier above lets it go: keep it on disk
            if node.checkpoint_slot is not None:
                disk.write_back(node, Tier.DEVICE, node.checkpoint_slot)
            elif node.host_slot is not None and not node.ckpt_moving:
                disk.write_back(node, Tier.HOST, node.host_slot)
        if node.checkpoint_slot is not None:
            self.ckpts.drop(node)
        self.host.drop_below(node)
        if node.host_slot is not None:
            self.host.drop_checkpoint(node)
        self.kv.remove_leaf(node)

    def drop_subtree(self, top: Node) -> None:
        """Drop ``top`` and everything below it, both tiers, deepest first (none pinned)."""
        order = [top]
        for node in order:
            order.extend(node.children.values())
        for node in reversed(order):
            if node.block_id < 0:
                self.host.remove(node)
                continue
            if node.checkpoint_slot is not None:
                self.ckpts.drop(node)
            if node.host_slot is not None:
                self.host.drop_checkpoint(node)
            self.kv.remove_leaf(node)

    # ------------------------------------------------------------------ up
    def make_room(self, path: Sequence[Node], need: int) -> bool:
        """``need`` free device blocks, evicting leaves off ``path`` (pinned meanwhile, with
        the checkpoint that ends it: making room may demote, and so evict on the host)."""
        for node in path:
            self.tree.pin(node)
        if path:
            self.tree.pin_checkpoint(path[-1])
        try:
            while self.blocks.num_free < need:
                if not self.free_one_block():
                    return False
            return True
        finally:
            if path:
                self.tree.unpin_checkpoint(path[-1])
            for node in path:
                self.tree.unpin(node)

    def promote(self, seq: SeqCache, on_host: list[Node]) -> None:
        """Give each host node of ``seq``'s hit a device block and queue its load."""
        for node in on_host:  # top-down: each one's parent is on the device already
            self.tree.promote(node, self.blocks.allocate())
            self.tree.set_moving(node, True)
            seq.loads.append(Transfer(TransferKind.KV_LOAD, node, node.host_block, node.block_id, seq))

    def pin_restore_source(self, seq: SeqCache, node: Node) -> None:
        """``seq`` resumes from ``node``'s checkpoint: a device one is copied in the first
        step, a host one is loaded straight into the live slot."""
        if node.checkpoint_slot is not None:
            self.ckpts.pin_restore(seq, node)
            return
        self.ckpts.pin_source(node)
        assert node.host_slot is not None
        seq.loads.append(Transfer(TransferKind.STATE_LOAD, node, node.host_slot, seq.state_slot, seq))

    def load_from_disk(self, seq: SeqCache, fetch: DiskFetch, hit: int) -> None:
        """``seq`` resumes at ``fetch.end_block``: private blocks for the disk's KV after the
        tree hit, loads of those blocks (by index in the block table: a block may move before
        its load runs) and of the checkpoint into the live slot."""
        assert self.disk.tier is not None
        end = fetch.end_block
        self.kv.grow(seq, end - hit)
        for i in range(hit, end):
            payload = fetch.kv[i - fetch.start_block]
            seq.loads.append(Transfer(TransferKind.DISK_KV_LOAD, None, i, -1, seq, payload=payload))
        seq.loads.append(
            Transfer(TransferKind.DISK_STATE_LOAD, None, 0, seq.state_slot, seq, payload=fetch.state)
        )
        seq.num_cached_tokens = end * self.block_size
        seq.disk_hit_tokens = (end - hit) * self.block_size

    # ------------------------------------------------------------------ per step
    def has_transfers(self) -> bool:
        """Copies wait for a step (a step with no forward may run just for them)."""
        disk = self.disk.tier
        return bool(self.load_queue.staged or self.host.saves or (disk is not None and disk.saves))

    def plan_transfers(self, plan: StepPlan) -> None:
        """Hand ``plan`` every copy due this step; after its captures were staged, which may
        have demoted checkpoints and moved KV blocks."""
        plan.saves, self.host.saves = self.host.saves, []
        if self.budget is not None:
            plan.moves = self.budget.take_moves()
        plan.loads = self.load_queue.take()
        disk = self.disk.tier
        if disk is not None:
            disk.plan_writes()
            plan.disk_saves = disk.take_saves()
            for t in plan.loads:  # by index: the block may have moved since admission
                if t.kind is TransferKind.DISK_KV_LOAD:
                    t.dst = t.seq.block_table[t.src]  # type: ignore[union-attr]

    def check_integrity(self, nodes: list[Node], active: list[SeqCache], inflight: StepPlan | None) -> None:
        """Assert the host tier's accounting and that every load is where it belongs."""
        saves = inflight.saves if inflight is not None and not inflight.landed else []
        self.host.check_integrity(nodes, active, saves)
        for seq in active:
            assert all(t.seq is seq for t in seq.loads), "a load queued on the wrong request"
        staged = [t for seq in active for t in seq.loads if t.staged]
        planned = self.load_queue.staged + (
            inflight.loads if inflight is not None and not inflight.landed else []
        )
        assert sorted(map(id, staged)) == sorted(map(id, planned)), "staged loads drift"
