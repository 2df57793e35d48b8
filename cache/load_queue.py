"""Loads from the host tier: staged a byte budget per step, landed, or cancelled.

A hit that reaches into the host tier leaves *loads* on its request (``SeqCache.loads``:
host KV blocks promoted into device blocks, and the restore from a host checkpoint), made
by ``CacheManager.admit``. This queue owns their life after that:

* ``stage(seq)`` puts a request's pending loads into the next step, up to
  ``budget`` bytes per step (at least one copy per step, however large); ``take()`` hands
  the staged ones to the step's plan.
* ``land(plan, failed)``: the plan's copies ran. Saves (planned by ``HostTier``) land or
  drop their item; landed loads make their nodes usable; a request's loads fail together
  (the deeper need the shallower) and that request is returned for the caller to end.
* ``cancel(seq)``: a request ends before its loads landed; what it promoted goes back
  to the host, its host restore is unpinned.

Disk loads (``TransferKind.DISK_*``: bytes read before admission into the request's private
blocks and live slot) ride the same queue, budget and landing; they touch no tree node.

Invariant: a staged load is in exactly one of ``staged`` (waiting for a step) or the
in-flight plan's ``loads``; ``CacheManager.check_integrity`` checks the two together.
Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.checkpoint_store import CheckpointStore
from deltaserve.cache.host_tier import HostTier
from deltaserve.cache.radix_tree import RadixTree
from deltaserve.cache.types import SeqCache, StepPlan, Transfer, TransferKind


class LoadQueue:
    def __init__(
        self,
        tree: RadixTree,
        blocks: BlockPool,
        host: HostTier,
        ckpts: CheckpointStore,
        budget: int | None,
    ) -> None:
        self.tree, self.blocks, self.host, self.ckpts = tree, blocks, host, ckpts
        self.counters: dict[str, int] = dict.fromkeys(
            ("host.loads_completed", "host.load_wait_ms", "host.kv_promoted_blocks",
             "host.checkpoints_restored", "host.bytes_loaded", "host.failed_loads", "disk.loads_completed",
             "disk.kv_loaded_blocks", "disk.checkpoints_loaded", "disk.bytes_loaded", "disk.failed_loads", "disk.load_wait_ms"), 0)  # fmt: skip
        self.budget = budget  # bytes of loads per step; None = unbounded
        self.staged: list[Transfer] = []  # loads staged for the next step's plan
        self.staged_bytes = 0

    def stage(self, seq: SeqCache) -> bool:
        """Stage ``seq``'s pending loads into the next step under the byte budget; True
        when all of them are staged."""
        for t in seq.loads:
            if t.staged:
                continue
            size = self._nbytes(t)
            if self.budget is not None and self.staged and self.staged_bytes + size > self.budget:
                return False
            t.staged = True
            self.staged.append(t)
            self.staged_bytes += size
        return True

    def _nbytes(self, t: Transfer) -> int:
        return t.nbytes_hint if t.kind.from_disk else self.host.nbytes(t.kind)

    def take(self) -> list[Transfer]:
        """The staged loads, for the step being planned (the queue starts empty again)."""
        staged, self.staged, self.staged_bytes = self.staged, [], 0
        return staged

    def land(self, plan: StepPlan, failed: Collection[Transfer] = ()) -> list[SeqCache]:
        """The plan's copies ran (``failed``: those that did not). Returns the requests whose
        loads failed: the caller ends them (they hold nothing else of the step).

        Each copy lands whole or not at all and leaves the plan when it has: if landing one
        raises, the plan stays unlanded holding the rest, for ``CacheManager.abort_step``."""
        if plan.landed:
            return []
        failed_ids = {id(t) for t in failed}
        done = 0
        try:
            for t in plan.saves:
                if id(t) in failed_ids:
                    self.host.save_failed(t)
                else:
                    self.host.save_landed(t)
                done += 1
        finally:
            if done < len(plan.saves):  # raised: what landed leaves the plan
                del plan.saves[:done]
        broken: list[SeqCache] = []
        for t in plan.loads:
            if id(t) in failed_ids and t.seq not in broken:
                broken.append(t.seq)  # type: ignore[arg-type]
        now = time.monotonic()
        done = 0
        try:
            for t in plan.loads:
                self._land_load(t, t.seq in broken, id(t) in failed_ids, now)
                done += 1
        finally:
            if done < len(plan.loads):  # raised: the saves have all landed
                del plan.saves[:], plan.loads[:done]
        plan.landed = True
        return broken

    def _land_load(self, t: Transfer, broken: bool, failed: bool, now: float) -> None:
        """One load ran (``broken``: its request's loads failed); applied whole or not at all."""
        seq = t.seq
        assert seq is not None
        counters = self.counters
        if broken:
            t.staged = False
            counters["disk.failed_loads" if t.kind.from_disk else "host.failed_loads"] += failed
            return
        if t.kind.from_disk:
            self._land_disk(t, seq, now)
            return
        if t.kind is TransferKind.KV_LOAD:
            assert t.node is not None
            self.tree.set_moving(t.node, False)
            try:
                self.host.release_block(t.node)
            except BaseException:
                self.tree.set_moving(t.node, True)
                raise
            counters["host.kv_promoted_blocks"] += 1
        else:
            assert t.node is not None
            self.ckpts.unpin_source(t.node)
            seq.restored_from = t.node
            counters["host.checkpoints_restored"] += 1
        t.staged = False
        seq.loads.remove(t)
        counters["host.bytes_loaded"] += self.host.nbytes(t.kind)
        if not seq.loads:
            counters["host.loads_completed"] += 1
            counters["host.load_wait_ms"] += round(1000 * (now - seq.load_since))

    def _land_disk(self, t: Transfer, seq: SeqCache, now: float) -> None:
        """A disk load ran: its bytes are in the request's block or live slot."""
        counters = self.counters
        kv = t.kind is TransferKind.DISK_KV_LOAD
        counters["disk.kv_loaded_blocks" if kv else "disk.checkpoints_loaded"] += 1
        counters["disk.bytes_loaded"] += t.nbytes_hint
        t.staged = False
        t.payload = None
        seq.loads.remove(t)
        if not seq.loads:
            counters["disk.loads_completed"] += 1
            counters["disk.load_wait_ms"] += round(1000 * (now - seq.load_since))

    def cancel(self, seq: SeqCache) -> None:
        """``seq`` ends before its loads landed: its promoted nodes go back to the host
        (deepest first; the request has unpinned them), its host restore is unpinned."""
        if any(t.staged for t in seq.loads):
            self.staged = [t for t in self.staged if t.seq is not seq]
            self.staged_bytes = sum(self._nbytes(t) for t in self.staged)
        for t in reversed(seq.loads):
            if t.kind.from_disk or t.node is None:
                continue  # private blocks and the live slot: the request's release frees them
            if t.kind is TransferKind.KV_LOAD:
                self.blocks.free(self.tree.demote(t.node, t.node.host_block))
                self.tree.set_moving(t.node, False)
            else:
                self.ckpts.unpin_source(t.node)
        seq.loads = []
