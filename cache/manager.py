"""The cache manager: the façade the scheduler and the engine use (DESIGN.md, "Cache model").

Its parts, each wired in the constructor here: the KV prefix index (``prefix_index.py``),
the checkpoint store (``checkpoint_store.py``), the value model (``eviction.py``), the host
tier (``host_tier.py``), the socket of the disk tier (``disk_link.py``: ``attach_disk``),
the one device budget (``shared_budget.py``), the load queue (``load_queue.py``), the moves
between tiers (``tiering.py``) and admission (``admitter.py``).

* ``admit_request``: one call admits a request from its match (``match``, computed once
  and kept per request until the index changes): disk hit, shared-prefix wait, live slot,
  pins, promotions and loads, first chunk's blocks, and its query counted once.
* ``allocate`` grows a request's block table, evicting unpinned leaves when needed.
* ``plan_step`` stages this step's captures (``planning.plan_captures``) under the per-step
  byte budget and the checkpoint slots: free ones, or the slot of a checkpoint worth less
  (``eviction.py``); what does not fit is *skipped* (counted by reason), never failed; and
  hands the step every copy between tiers due. ``commit_step`` publishes computed blocks
  and captured checkpoints after the step succeeded; ``abort_step`` releases the
  reservations of a failed step.
* ``free`` ends a request (finish, abort, preemption, error): unpins, returns private
  blocks and slots, and on a normal finish publishes its output checkpoint.
* ``check_integrity`` proves the accounting of each part (every block and slot in exactly
  one state, ref counts = pins), across every tier.

A hit's host or disk items are loaded before its request computes (``stage_loads``,
``land_transfers``), so nobody else's decode waits for them; a failed save drops its item,
a failed load ends only the request that needed it.

Torch-free: plain ints and lists, so it is fuzzed by the thousand and replayed by the
simulator at full speed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from deltaserve.cache.admission import get_admission_policy
from deltaserve.cache.admitter import Admitter
from deltaserve.cache.arena import Arena
from deltaserve.cache.block_pool import BlockPool, PagedBlockPool
from deltaserve.cache.checkpoint_store import CheckpointStore
from deltaserve.cache.disk_link import DiskLink
from deltaserve.cache.disk_tier import DiskTier
from deltaserve.cache.eviction import CostModel, EvictionParams
from deltaserve.cache.eviction_policies import make_eviction
from deltaserve.cache.host_tier import HostTier
from deltaserve.cache.load_queue import LoadQueue
from deltaserve.cache.loss import MISS_KEYS, PLAIN, Asked, LossAttribution
from deltaserve.cache.manager_config import GDN_CHUNK_SIZE, CacheManagerConfig, checkpoint_unit
from deltaserve.cache.planning import plan_captures
from deltaserve.cache.prefix_index import PrefixIndex
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.shared_budget import SharedBudget
from deltaserve.cache.tiering import Tiering
from deltaserve.cache.types import (
    Admission,
    AdmitStatus,
    Capture,
    CaptureKind,
    CheckpointGranularity,
    PrefixMatch,
    SeqCache,
    StepItem,
    StepPlan,
    Transfer,
)

__all__ = [
    "GDN_CHUNK_SIZE",
    "CacheManager",
    "CacheManagerConfig",
    "checkpoint_unit",
    "Capture",
    "SeqCache",
    "StepItem",
    "StepPlan",
]


# ``stats()`` reports every part's counters in this order
COUNTER_KEYS = (
    "prefix_cache.queries", "prefix_cache.query_tokens", "prefix_cache.hit_tokens",
    "checkpoints.stored", "checkpoints.restored", "checkpoints.skipped_budget",
    "checkpoints.skipped_pool", "checkpoints.skipped_value", "checkpoints.duplicate",
    "checkpoints.evicted", "kv.evicted_blocks", "prefix_cache.hit_tokens_device",
    "prefix_cache.hit_tokens_host", "host.loads_completed", "host.load_wait_ms",
    "host.kv_demoted_blocks", "host.kv_promoted_blocks", "host.kv_evicted_blocks",
    "host.checkpoints_demoted", "host.checkpoints_restored", "host.checkpoints_evicted",
    "host.bytes_saved", "host.bytes_loaded", "host.failed_saves", "host.failed_loads",
    "kv.moved_blocks", "cache.pages_to_kv", "cache.pages_to_checkpoints", "checkpoints.evicted_for_kv",
    "cache.kv_refused",
    "host.checkpoints_refused", "host.kv_moved_blocks",
    "prefix_cache.hit_tokens_disk", "disk.loads_completed", "disk.kv_loaded_blocks",
    "disk.checkpoints_loaded", "disk.bytes_loaded", "disk.failed_loads", "disk.load_wait_ms",
    *MISS_KEYS,
)  # fmt: skip


class CacheManager:
    def __init__(self, config: CacheManagerConfig) -> None:
        self.config = config
        bs = self.block_size = config.block_size
        self.has_gdn = config.has_gdn
        self.unit = checkpoint_unit(bs, config.has_gdn, config.checkpoint_granularity, config.gdn_chunk_size)
        # interval captures keep to the kernel's chunk grid, where a capture is only a copy
        grid = checkpoint_unit(bs, config.has_gdn, CheckpointGranularity.CHUNK, config.gdn_chunk_size)
        interval = config.checkpoint_interval
        self.interval = -(-interval // grid) * grid if interval > 0 else 0
        self.enabled = config.enable_prefix_caching
        self.policy = get_admission_policy(config.checkpoint_policy)
        num_ckpt = config.num_checkpoint_slots if (self.has_gdn and self.enabled) else 0
        num_live = config.num_live_slots if self.has_gdn else 0
        self.tree = RadixTree()
        self.eviction = make_eviction(
            self.policy.eviction,
            self.tree,
            EvictionParams(
                block_size=bs,
                unit_blocks=self.unit // bs,
                checkpoint_bytes=config.checkpoint_bytes,
                num_checkpoint_slots=config.num_checkpoint_slots,
                cost=CostModel(config.prefill_cost_per_token, config.prefill_cost_per_token_pair),
                kv_block_bytes=config.kv_block_bytes if config.shared_pages > 0 else 0,
            ),
        )
        self.disk_link = DiskLink()  # the disk tier's socket (``attach_disk``)
        self.host = HostTier(
            self.tree,
            self.eviction,
            num_blocks=config.num_host_kv_blocks if self.enabled else 0,
            num_slots=config.num_host_checkpoint_slots if num_ckpt else 0,
            num_pages=config.num_host_pages if self.enabled else 0,
            page_blocks=config.host_page_blocks,
            kv_block_bytes=config.kv_block_bytes,
            checkpoint_bytes=config.checkpoint_bytes,
            disk=self.disk_link,
        )
        self.budget: SharedBudget | None = None
        blocks: BlockPool | PagedBlockPool
        if num_ckpt and config.shared_pages > 0:
            n = config.page_blocks
            if n <= 0:
                raise ValueError(f"page_blocks must be positive with shared pages, got {n}")
            blocks = PagedBlockPool(n, config.shared_pages * n)
            headroom = n // 2 if config.headroom_blocks is None else config.headroom_blocks
            self.budget = SharedBudget(
                Arena(num_live, config.shared_pages, n),
                blocks,
                self.tree,
                self.eviction,
                self._evict_leaf,
                lambda: self.active.values(),
                headroom,
                bs,
            )
            num_ckpt = 0  # checkpoint slots come and go with their pages
        else:
            blocks = BlockPool(config.num_kv_blocks)
        self.kv = PrefixIndex(self.tree, self.host, bs, blocks, has_gdn=config.has_gdn)
        self.blocks = self.kv.blocks
        self.ckpts = CheckpointStore(
            num_live,
            num_ckpt,
            self.kv,
            self.eviction,
            self.host,
            config.checkpoint_bytes,
            grow=self.budget.checkpoint_page if self.budget is not None else None,
            on_skip=self.budget.ghost if self.budget is not None else None,
            disk=self.disk_link,
        )
        if self.budget is not None:
            # (the one circle: the budget frees checkpoint pages, the store grows by them)
            self.budget.ckpts = self.ckpts
        self.slots = self.ckpts.slots
        self.load_queue = LoadQueue(
            self.tree, self.blocks, self.host, self.ckpts, config.host_load_bytes_per_step
        )
        self._counters: dict[str, int] = dict.fromkeys(
            ("prefix_cache.queries", "prefix_cache.query_tokens", "prefix_cache.hit_tokens",
             "prefix_cache.hit_tokens_device", "prefix_cache.hit_tokens_host", "prefix_cache.hit_tokens_disk",
             "checkpoints.restored", "checkpoints.duplicate"), 0)  # fmt: skip
        self.active: dict[str, SeqCache] = {}
        self.tiers = Tiering(
            self.kv,
            self.ckpts,
            self.host,
            self.disk_link,
            self.load_queue,
            self.eviction,
            self.budget,
            self.active,
            has_gdn=self.has_gdn,
        )
        self._inflight: StepPlan | None = None
        self.admitter = Admitter(
            self.kv,
            self.ckpts,
            self.tiers,
            self.disk_link,
            self.budget,
            self.active,
            unit=self.unit,
            has_gdn=self.has_gdn,
            enabled=self.enabled,
        )
        # where the misses went (``cache/loss.py``): told of every eviction and declined capture
        self.loss = LossAttribution.wire(self.kv, self.ckpts, self.disk_link, config, self.unit)
        # the admission steps, for callers that take them one by one (``cache/admitter.py``)
        self.match = self.admitter.match
        self.admit = self.admitter.admit
        self.disk_fetch = self.admitter.disk_fetch
        self.wait_for_shared_prefix = self.admitter.wait_for_shared_prefix

    def set_prefill_cost(self, per_token: float, per_token_pair: float) -> None:
        """The value model's prefill cost parameters (``CacheManagerConfig``), e.g. from the
        model's shape."""
        self.config.prefill_cost_per_token = per_token
        self.config.prefill_cost_per_token_pair = per_token_pair
        self.eviction.set_cost(CostModel(per_token, per_token_pair))

    def attach_disk(self, disk: DiskTier) -> None:
        """Use ``disk`` as the tier below the host (``cache/disk_tier.py``): published
        checkpoints are written through, evicted ones written back, hits read from it."""
        if not (self.enabled and self.has_gdn):
            raise ValueError("a disk tier needs prefix caching and a model with GDN layers")
        self.disk_link.tier = disk

    def detach_disk(self) -> None:
        """Go on without the disk tier (it is being closed); fetches in flight are dropped."""
        self.disk_link.tier = None

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier plugged in (``attach_disk``), if any."""
        return self.disk_link.tier

    @property
    def counters(self) -> dict[str, int]:
        """Every part's event counters, summed (a fresh dict, in ``COUNTER_KEYS`` order)."""
        total = dict.fromkeys(COUNTER_KEYS, 0)
        parts = [
            self._counters,
            self.tiers.counters,
            self.ckpts.counters,
            self.load_queue.counters,
            self.host.counters,
            self.loss.counters,
        ]
        if self.budget is not None:
            parts.append(self.budget.counters)
        for part in parts:
            for key, n in part.items():
                total[key] += n
        return total

    # ------------------------------------------------------------------ matching
    def extend_hashes(self, token_ids: Sequence[int], salt: bytes, hashes: list[int]) -> list[int]:
        return self.kv.extend_hashes(token_ids, salt, hashes)

    # ------------------------------------------------------------------ admission
    def admit_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        salt: bytes,
        match: PrefixMatch,
        first_chunk: Callable[[int], int | None],
        *,
        prompt_len: int,
        hashes: list[int],
        whole_prompt: bool = False,
        wait_tokens: int = 0,
        preempted_tokens: int | None = None,
    ) -> Admission:
        """Admit one request in one call, from its ``match`` (computed once, passed on):

        1. its disk hit beyond the match (``disk_fetch``); still being read: WAITING;
        2. a prefix another request computes now (``wait_for_shared_prefix``, at least
           ``wait_tokens`` past the hit): WAITING;
        3. its first chunk, ``first_chunk(hit_tokens)``: the end, or None (NO_FIT);
        4. its cache view (``admit``); no live slot or no room to promote its hit: NO_FIT;
        5. a hit with copies to land: its loads staged (LOADING); else blocks for the first
           chunk (ADMITTED; none: undone, NO_FIT: new requests never preempt running ones).

        ``whole_prompt`` (a request that computes its whole prompt) skips 1 and 2. An
        admission counts its query once: ``record_query`` on the first admission
        (``preempted_tokens`` None), else ``note_recompute_hit``.
        """
        hit = match.hit_tokens
        disk = None if whole_prompt else self.disk_fetch(request_id, token_ids, match)
        if disk is not None and not disk.done:
            return Admission(AdmitStatus.WAITING)  # the others go on meanwhile
        if not whole_prompt and self.wait_for_shared_prefix(match, token_ids, wait_tokens):
            return Admission(AdmitStatus.WAITING)  # resume from the other's checkpoint
        end = first_chunk(hit)
        if end is None:
            return Admission(AdmitStatus.NO_FIT)
        seq = self.admit(
            request_id, token_ids, salt, prompt_len=prompt_len, hashes=hashes, match=match, disk=disk
        )
        if seq is None:
            return Admission(AdmitStatus.NO_FIT)
        # nothing changed since the match: admission found the same hit (or the disk's beyond it)
        assert seq.num_cached_tokens == hit + seq.disk_hit_tokens
        if seq.loads:
            self._count_admission(seq, len(token_ids), preempted_tokens, whole_prompt)
            self.stage_loads(seq)
            return Admission(AdmitStatus.LOADING, seq, seq.num_cached_tokens, seq.num_cached_tokens)
        if not self.allocate(seq, end, admission=True):
            self.free(seq, publish_output=False)
            return Admission(AdmitStatus.NO_FIT)
        self._count_admission(seq, len(token_ids), preempted_tokens, whole_prompt)
        return Admission(AdmitStatus.ADMITTED, seq, hit, end)

    def _count_admission(self, seq: SeqCache, query: int, preempted_tokens: int | None, whole: bool) -> None:
        if preempted_tokens is None:  # (``given_up``: why its disk hit was dropped, if it was)
            lost = self.disk.given_up(seq.request_id) if self.disk is not None else None
            self.record_query(query, seq.num_cached_tokens, seq, Asked(whole, lost))
        else:  # a preemption's recompute, less what the cache serves it (never a gain)
            served = min(seq.num_cached_tokens, preempted_tokens)
            self.note_recompute_hit(served)
            self.loss.recompute(preempted_tokens - served)

    @property
    def num_free_live_slots(self) -> int:
        return self.slots.num_free_live if self.has_gdn else 1 << 30

    def blocks_for(self, num_tokens: int) -> int:
        return self.kv.blocks_for(num_tokens)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.blocks.max_blocks

    def wait_for_disk(self, timeout: float = 0.005) -> None:
        """Block up to ``timeout`` seconds for a read from disk to finish (when nothing else
        can run, instead of spinning); returns at once when none is being read."""
        if self.disk is not None:
            self.disk.wait(timeout)

    def forget(self, request_id: str) -> None:
        """A request that was never admitted (or has ended) is gone: its fetch too."""
        if self.disk is not None:
            self.disk.forget(request_id)

    # ------------------------------------------------------------------ host tier
    def stage_loads(self, seq: SeqCache) -> bool:
        """Stage ``seq``'s pending loads into the next step (``LoadQueue.stage``)."""
        return self.load_queue.stage(seq)

    def has_transfers(self) -> bool:
        """Copies wait for a step (a step with no forward may run just for them)."""
        return self.tiers.has_transfers()

    def land_transfers(self, plan: StepPlan, failed: Collection[Transfer] = ()) -> list[SeqCache]:
        """The plan's copies ran; the requests whose loads failed (``LoadQueue.land``)."""
        return self.load_queue.land(plan, failed)

    def record_query(
        self, query_tokens: int, hit_tokens: int, seq: SeqCache | None = None, asked: Asked = PLAIN
    ) -> None:
        """Count one prompt lookup in the hit-rate stats (once per request, by the caller) and its
        misses by cause (``LossAttribution.attribute``, given what was ``asked``); with ``seq``,
        the eviction strategy also learns which earlier capture it would reuse."""
        counters = self._counters
        counters["prefix_cache.queries"] += 1
        counters["prefix_cache.query_tokens"] += query_tokens
        counters["prefix_cache.hit_tokens"] += hit_tokens
        host = seq.host_hit_tokens if seq is not None else 0
        disk = seq.disk_hit_tokens if seq is not None else 0
        counters["prefix_cache.hit_tokens_host"] += host
        counters["prefix_cache.hit_tokens_disk"] += disk
        counters["prefix_cache.hit_tokens_device"] += hit_tokens - host - disk
        self.loss.attribute(query_tokens, hit_tokens, seq, asked)
        if seq is not None and self.budget is not None:
            self.budget.on_query(seq.hashes, (query_tokens - 1) // self.block_size, hit_tokens)
        if seq is not None and self.has_gdn and self.enabled:
            bs = self.block_size
            seq.history = self.eviction.observe(seq.hashes, (query_tokens - 1) // bs, self.unit // bs)

    def note_preemption(self, computed_tokens: int) -> None:
        """A running request was preempted with ``computed_tokens`` to recompute (the one
        budget weighs that against the hits its checkpoints would have served)."""
        if self.budget is not None:
            self.budget.adjust(-computed_tokens)

    def note_recompute_hit(self, hit_tokens: int) -> None:
        """A preempted request came back and ``hit_tokens`` of what it had computed were served
        from the cache (so its preemption cost that much less)."""
        if self.budget is not None:
            self.budget.adjust(hit_tokens)

    # ------------------------------------------------------------------ KV blocks
    def _evict_leaf(self, node: Node) -> None:
        """(the shared budget's way to free a device KV leaf: ``Tiering.evict_leaf``)"""
        self.tiers.evict_leaf(node)

    def allocate(self, seq: SeqCache, num_tokens: int, *, admission: bool = False) -> bool:
        """Make ``seq.block_table`` cover ``num_tokens`` tokens; False if impossible now.

        On False nothing is allocated (so a preempting caller loses nothing).
        """
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        while self.blocks.num_free < need:
            if not self.tiers.free_one_block(admission):
                return False
        self.kv.grow(seq, need)
        self.ckpts.compact()
        return True

    # ------------------------------------------------------------------ steps
    def plan_step(self, items: list[StepItem]) -> StepPlan:
        """Copies between tiers, restores to run before the forward, captures to write
        under the staging budget."""
        if self._inflight is not None:
            raise RuntimeError("a step is already in flight")
        plan = StepPlan(items=items)
        self._inflight = plan
        self._plan_checkpoints(plan)
        self.tiers.plan_transfers(plan)  # last: staging may have demoted and moved
        return plan

    def _plan_checkpoints(self, plan: StepPlan) -> StepPlan:
        items = plan.items
        if not self.has_gdn:
            return plan

        for item in items:
            seq = item.seq
            if seq.restore_node is not None:
                plan.restores.append((seq.restore_node.checkpoint_slot, seq.state_slot))  # type: ignore[arg-type]
                plan.restored.append(seq)
        if not self.enabled:
            return plan
        budget = self.config.staging_bytes
        remaining = None if budget is None else budget // max(self.config.checkpoint_bytes, 1)
        candidates = plan_captures(items, self.policy, unit=self.unit, interval=self.interval)
        self.ckpts.stage_captures(plan, candidates, remaining, shield_tails=self.policy.track_output)
        return plan

    def commit_step(self, plan: StepPlan) -> None:
        """The step succeeded: publish blocks computed and checkpoints captured.

        Whole pieces: each piece of the plan (a landed copy, a released restore, a published
        block, an attached capture) is applied whole or not at all, and a piece applied
        leaves what ``abort_step`` releases. The plan leaves flight only once every piece is
        in, so a commit that raises half-way leaves every structure whole and its plan in
        flight, holding the rest for ``abort_step`` (docs/cache.md, "A commit that fails").
        """
        if plan is not self._inflight:
            raise RuntimeError("commit of a plan that is not in flight")
        self.land_transfers(plan)  # no-op when the caller landed them already
        for seq in plan.restored:  # (a restore not released here is released by ``free``)
            self.ckpts.release_restore(seq)
            self._counters["checkpoints.restored"] += 1
        enabled, kv = self.enabled, self.kv
        for item in plan.items:
            seq = item.seq
            if enabled:
                kv.publish(seq, item.token_ids, item.end)
            if seq.pending_tracking_boundary:
                seq.tracking_boundary = seq.pending_tracking_boundary
                seq.pending_tracking_boundary = 0
        done = 0
        try:
            for cap in plan.captures:
                if not cap.tracking:
                    self._commit_capture(plan, cap)
                done += 1
        except BaseException:
            applied = {c.slot for c in plan.captures[:done]}
            plan.reserved = [slot for slot in plan.reserved if slot not in applied]
            raise
        self._inflight = None

    def _commit_capture(self, plan: StepPlan, cap: Capture) -> None:
        """Publish a captured checkpoint at its node, or free its slot (a duplicate)."""
        seq = plan.items[cap.item_index].seq
        node = self.kv.node_at(seq, cap.boundary)
        if node is None or node.checkpoint_slot is not None or not self.enabled:
            self.slots.free_checkpoint(cap.slot)
            self._counters["checkpoints.duplicate"] += 1
            return
        self.ckpts.attach(node, cap.slot, cap.kind, seq.history)

    def abort_step(self, plan: StepPlan) -> None:
        """The step failed, or its commit raised: release its reservations (what a failed
        commit left in the plan). Its requests must then be freed."""
        if plan is not self._inflight:
            raise RuntimeError("abort of a plan that is not in flight")
        undo = not plan.landed and bool(plan.moves)
        if not plan.landed:  # the copies may not have run: saves are lost, loads retried
            plan.landed = True
            for t in plan.saves:
                self.host.save_failed(t)
            for t in plan.loads:
                t.staged = False
        self._inflight = None
        for slot in plan.reserved:
            self.slots.free_checkpoint(slot)
        for item in plan.items:
            item.seq.pending_tracking_boundary = 0
        if undo and self.budget is not None:  # nothing was copied: back where the bytes are
            self.budget.undo_moves(plan.moves)

    def in_flight(self, plan: StepPlan) -> bool:
        """``plan`` is the step in flight (planned, neither committed nor aborted)."""
        return plan is self._inflight

    def discard_written(self, blocks: Collection[int], slots: Collection[int]) -> int:
        """Drop every cached entry held in ``blocks`` (KV block ids) or ``slots`` (checkpoint
        slots); the number dropped.

        For a step whose plan was committed before its forward ran (the engine's async
        scheduling) and whose forward then failed: what that commit published was never
        written. The step's requests (and any admitted onto its results) must have ended
        first, so nothing pins these entries; nodes go deepest first (a KV node published by
        the step has only such nodes below it).
        """
        blocks, slots = set(blocks), set(slots)
        nodes = [n for n in self.tree.nodes() if n.block_id in blocks or n.checkpoint_slot in slots]
        for node in sorted(nodes, key=lambda n: -n.depth):
            if node.parent is None:
                continue  # gone with a block above it
            if node.block_id in blocks:
                self.tiers.drop_subtree(node)
            else:
                self.ckpts.drop(node)
        return len(nodes)

    def publish(self, seq: SeqCache, token_ids: Sequence[int], num_computed: int) -> None:
        """Insert the request's newly full, computed blocks into the tree (and pin them)."""
        if self.enabled:
            self.kv.publish(seq, token_ids, num_computed)

    # ------------------------------------------------------------------ end of a request
    def free(self, seq: SeqCache, *, publish_output: bool = True) -> None:
        """Release everything the request holds; its published blocks stay cached."""
        if self.active.get(seq.request_id) is not seq:
            raise RuntimeError(f"free of unknown request {seq.request_id!r}")
        if self._inflight is not None and any(it.seq is seq for it in self._inflight.items):
            raise RuntimeError("free of a request in the in-flight step")
        inflight = self._inflight
        if (
            seq.loads
            and inflight is not None
            and not inflight.landed
            and any(t.seq is seq for t in inflight.loads)
        ):
            raise RuntimeError("free of a request whose loads are in flight")
        del self.active[seq.request_id]
        self.ckpts.release_restore(seq)
        self.kv.release_inflight(seq)
        if publish_output and self.policy.track_output and self.enabled:
            # the output boundary, stored or not, is a proposed capture
            b = len(seq.nodes) * self.block_size // self.unit * self.unit
            if b > (seq.prompt_len - 1) // self.unit * self.unit:
                self.eviction.on_propose(
                    seq.hashes[b // self.block_size - 1], CaptureKind.OUTPUT, seq.history
                )
        self.ckpts.end_tracking(seq, publish_output)
        self.kv.release(seq)
        if seq.loads:
            self.load_queue.cancel(seq)
        if seq.state_slot >= 0:
            self.slots.free_live(seq.state_slot)
            seq.state_slot = -1

    # ------------------------------------------------------------------ reporting
    def usage(self) -> dict[str, int | float]:
        """Pool occupancy; O(1), so it can be sampled after every step."""
        shared = self.budget.usage() if self.budget is not None else {}
        disk = self.disk.stats() if self.disk is not None else {}
        return {**self.kv.usage(), **self.ckpts.usage(), **self.host.usage(), **shared, **disk}

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.counters)
        q = out["prefix_cache.query_tokens"]
        out["prefix_cache.hit_rate"] = out["prefix_cache.hit_tokens"] / q if q else 0.0
        out.update(self.usage())
        out.update(self.eviction.stats())
        return out

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Assert every block, slot and ref count is accounted for exactly once."""
        active = list(self.active.values())
        nodes = self.kv.check_integrity(active)
        if not self.has_gdn:
            assert all(n.checkpoint_slot is None for n in nodes), "checkpoint on a model without GDN layers"
        else:
            assert all(s.state_slot >= 0 for s in active), "active request without live slot"
        reserved = set(self._inflight.reserved) if self._inflight else set()
        self.ckpts.check_integrity(nodes, active, reserved, self.unit // self.block_size)
        if self.budget is not None:
            self.budget.check_integrity()
        self.tiers.check_integrity(nodes, active, self._inflight)
        self.loss.check(self._counters)
