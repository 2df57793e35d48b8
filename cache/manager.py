"""The cache manager: joint KV + GDN-checkpoint prefix cache, pins, staging, eviction.

Contract (DESIGN.md, "Cache model"):

* ``admit`` finds the **joint hit** — the deepest boundary ``b <= len(prompt) - 1`` with
  every block of ``[0, b)`` in the tree and a checkpoint at ``b`` (the checkpoint
  condition is void for a model without GDN layers) — pins that path, takes a live
  state slot and pins the checkpoint to restore from.
* ``allocate`` grows a request's block table, evicting unpinned LRU leaves when needed.
* ``plan_step`` stages this step's captures under the per-batch byte budget and the
  free + evictable checkpoint slots; what does not fit is *skipped* (counted), never
  failed. ``commit_step`` publishes computed blocks and captured checkpoints after the
  step succeeded; ``abort_step`` releases the reservations of a failed step.
* ``free`` ends a request (finish, abort, preemption, error): unpins, returns private
  blocks and slots, and on a normal finish publishes its output checkpoint.
* ``check_integrity`` proves the accounting (every block and slot in exactly one state).

Block table layout of one request (``SeqCache``)::

    block_table: [ n_0 ... n_{k-1} | p_k ... p_{m-1} ]
                   ^ nodes[i].block_id   ^ private blocks, owned by the request
                   (pinned tree nodes)     (the last may be partial; never shared)

Torch-free: plain ints and lists, so it is fuzzed by the thousand and replayed by the
simulator at full speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from deltaserve.cache.admission import CaptureContext, get_admission_policy
from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.hashing import block_hashes
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.state_pool import SlotState, StatePool

GDN_CHUNK_SIZE = 64


@dataclass
class CacheManagerConfig:
    block_size: int
    num_kv_blocks: int
    num_live_slots: int = 0
    num_checkpoint_slots: int = 0
    checkpoint_bytes: int = 0  # size of one checkpoint (all GDN layers)
    staging_bytes: int | None = None  # per-step capture budget; None = unbounded
    has_gdn: bool = True
    checkpoint_interval: int = 0  # tokens; rounded up to the unit; 0 = off
    checkpoint_policy: str = "default"
    enable_prefix_caching: bool = True
    gdn_chunk_size: int = GDN_CHUNK_SIZE


@dataclass(eq=False)
class SeqCache:
    """One request's view of the cache. Owned by the manager, held by the request."""

    request_id: str
    salt: bytes
    prompt_len: int
    block_table: list[int] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)  # pinned path, one per leading block
    state_slot: int = -1  # live GDN state slot (-1: model has no GDN layers)
    restore_node: Node | None = None  # checkpoint to copy into state_slot before the first step
    restored_from: Node | None = None  # the checkpoint the request resumed from (after the copy)
    num_cached_tokens: int = 0  # hit length at admission
    branch_boundary: int = 0
    tracking_slot: int = -1  # output-checkpoint slot during decode
    tracking_boundary: int = 0  # boundary the tracking slot holds (0: nothing valid)
    # chained hashes of the request's full blocks; the same list the request keeps
    # (``Request.block_hashes``), extended as tokens arrive, so nothing is hashed twice
    hashes: list[int] = field(default_factory=list)
    num_inflight: int = 0  # leading ``hashes`` registered as in flight while active
    pending_tracking_boundary: int = 0  # boundary being written by the in-flight step


@dataclass
class StepItem:
    """One request's piece of a step: tokens ``[start, end)`` get computed."""

    seq: SeqCache
    token_ids: Sequence[int]  # the request's tokens (prompt + output so far)
    start: int
    end: int
    is_decode: bool


@dataclass
class Capture:
    item_index: int  # index into StepPlan.items
    boundary: int  # absolute token boundary
    slot: int
    kind: str

    @property
    def tracking(self) -> bool:
        """Written into the request's tracking slot (published at finish), not a fresh slot."""
        return self.kind == "output"


@dataclass
class StepPlan:
    items: list[StepItem]
    restores: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint slot, live slot)
    captures: list[Capture] = field(default_factory=list)  # written by the prefill kernels
    decode_copies: list[tuple[int, int]] = field(
        default_factory=list
    )  # (live slot, tracking slot) after forward
    restored: list[SeqCache] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)  # slots in RESERVED state for captures


class CacheManager:
    def __init__(self, config: CacheManagerConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.has_gdn = config.has_gdn
        self.unit = (
            math.lcm(config.block_size, config.gdn_chunk_size) if config.has_gdn else config.block_size
        )
        interval = config.checkpoint_interval
        self.interval = -(-interval // self.unit) * self.unit if interval > 0 else 0
        self.enabled = config.enable_prefix_caching
        self.policy = get_admission_policy(config.checkpoint_policy)
        self.blocks = BlockPool(config.num_kv_blocks)
        num_ckpt = config.num_checkpoint_slots if (self.has_gdn and self.enabled) else 0
        self.slots = StatePool(config.num_live_slots if self.has_gdn else 0, num_ckpt)
        self.tree = RadixTree()
        self.active: dict[str, SeqCache] = {}
        self._inflight: StepPlan | None = None
        # full-block hashes of active requests' prompts -> number of such requests
        self._inflight_hashes: dict[int, int] = {}
        self.counters: dict[str, int] = {
            "prefix_cache.queries": 0,
            "prefix_cache.query_tokens": 0,
            "prefix_cache.hit_tokens": 0,
            "checkpoints.stored": 0,
            "checkpoints.restored": 0,
            "checkpoints.skipped_budget": 0,
            "checkpoints.skipped_pool": 0,
            "checkpoints.duplicate": 0,
            "checkpoints.evicted": 0,
            "kv.evicted_blocks": 0,
        }

    # ------------------------------------------------------------------ hashing / lookup
    def extend_hashes(self, token_ids: Sequence[int], salt: bytes, hashes: list[int]) -> list[int]:
        """Extend ``hashes`` (the chained hashes of the leading full blocks) in place."""
        parent = hashes[-1] if hashes else 0
        hashes.extend(block_hashes(token_ids, self.block_size, salt, start_block=len(hashes), parent=parent))
        return hashes

    def _match(
        self, token_ids: Sequence[int], salt: bytes, hashes: list[int] | None
    ) -> tuple[list[Node], int, list[int]]:
        """(matched path over the prompt's full blocks, joint-hit block count, block hashes)."""
        if not self.enabled or len(token_ids) == 0:
            return [], 0, []
        hashes = self.extend_hashes(token_ids, salt, hashes if hashes is not None else [])
        path = self.tree.match(hashes[: len(token_ids) // self.block_size])
        limit = (len(token_ids) - 1) // self.block_size  # at least one token is computed
        hit = min(len(path), limit)
        if self.has_gdn:
            while hit > 0 and path[hit - 1].checkpoint_slot is None:
                hit -= 1
        return path, hit, hashes

    def lookup(self, token_ids: Sequence[int], salt: bytes, hashes: list[int] | None = None) -> int:
        """Joint-hit length in tokens, without side effects (for cache-aware policies)."""
        return self._match(token_ids, salt, hashes)[1] * self.block_size

    # ------------------------------------------------------------------ admission
    @property
    def num_free_live_slots(self) -> int:
        return self.slots.num_free_live if self.has_gdn else 1 << 30

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.blocks.num_blocks

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        salt: bytes,
        *,
        prompt_len: int | None = None,
        hashes: list[int] | None = None,
    ) -> SeqCache | None:
        """Start caching for a request; None when no live state slot is free.

        Hit-rate stats are the caller's to record (``record_query``), once per request: an
        admission may be undone (no KV for it yet) and retried on a later step.
        """
        if request_id in self.active:
            raise RuntimeError(f"request {request_id!r} already admitted")
        if self.has_gdn and self.slots.num_free_live == 0:
            return None
        path, hit, hashes = self._match(token_ids, salt, hashes)
        seq = SeqCache(
            request_id=request_id, salt=salt, prompt_len=prompt_len or len(token_ids), hashes=hashes
        )
        for node in path[:hit]:
            self.tree.pin(node)
            self.tree.touch(node)
            seq.nodes.append(node)
            seq.block_table.append(node.block_id)
        hit_tokens = hit * self.block_size
        seq.num_cached_tokens = hit_tokens
        if self.has_gdn:
            seq.state_slot = self.slots.allocate_live()
        if self.has_gdn and self.enabled:
            if hit > 0:
                node = path[hit - 1]
                self.tree.pin_checkpoint(node)
                self.tree.touch_checkpoint(node)
                seq.restore_node = node
            # Branch: the prompt provably shares more than the deepest checkpoint covers, with
            # the tree or with a request still computing it (admitted in this or an earlier
            # step, not yet published): capture at the divergence.
            # A path that simply ends (a leaf: the previous turn of this very conversation)
            # is extended, not branched: only a path that goes on past the divergence, or
            # another request computing the same prefix, proves a shared boundary.
            shared = len(path)
            diverges = shared > 0 and bool(path[-1].children)
            full = len(token_ids) // self.block_size
            while shared < full and hashes[shared] in self._inflight_hashes:
                shared += 1
                diverges = True
            branch = (shared * self.block_size // self.unit) * self.unit
            if diverges and branch > hit_tokens:
                seq.branch_boundary = branch
            seq.num_inflight = full
            for h in hashes[:full]:
                self._inflight_hashes[h] = self._inflight_hashes.get(h, 0) + 1
        self.active[request_id] = seq
        return seq

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one prompt lookup in the hit-rate stats (once per request, by the caller)."""
        self.counters["prefix_cache.queries"] += 1
        self.counters["prefix_cache.query_tokens"] += query_tokens
        self.counters["prefix_cache.hit_tokens"] += hit_tokens

    # ------------------------------------------------------------------ KV blocks
    def _evict_one_leaf(self) -> bool:
        node = self.tree.peek_evictable_leaf()
        if node is None:
            return False
        if node.checkpoint_slot is not None:
            self.slots.free_checkpoint(self.tree.detach_checkpoint(node))
            self.counters["checkpoints.evicted"] += 1
        self.tree.remove_leaf(node)
        self.blocks.free(node.block_id)
        self.counters["kv.evicted_blocks"] += 1
        return True

    def allocate(self, seq: SeqCache, num_tokens: int) -> bool:
        """Make ``seq.block_table`` cover ``num_tokens`` tokens; False if impossible now.

        On False nothing is allocated (so a preempting caller loses nothing).
        """
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        while self.blocks.num_free < need:
            if not self._evict_one_leaf():
                return False
        for _ in range(need):
            seq.block_table.append(self.blocks.allocate())
        self.tree.compact()
        return True

    # ------------------------------------------------------------------ checkpoint slots
    def _reserve_slot(self, state: SlotState, *, max_class: int = 2) -> int:
        """A checkpoint slot in ``state``, evicting an unpinned checkpoint if needed; -1 if none.

        Only a checkpoint of eviction class <= ``max_class`` may be evicted (``RadixTree.ckpt_key``:
        0 dominated, 1 speculative, 2 proven shared), so a speculative capture never pushes
        out a checkpoint that has proven its worth.
        """
        if self.slots.num_free_checkpoint == 0:
            node = self.tree.peek_evictable_checkpoint()
            if node is None or self.tree.ckpt_key(node)[0] > max_class:
                return -1
            self.slots.free_checkpoint(self.tree.detach_checkpoint(node))
            self.counters["checkpoints.evicted"] += 1
        return self.slots.allocate_checkpoint(state)

    # ------------------------------------------------------------------ steps
    def plan_step(self, items: list[StepItem]) -> StepPlan:
        """Restores to run before the forward, captures to write, under the staging budget."""
        if self._inflight is not None:
            raise RuntimeError("a step is already in flight")
        plan = StepPlan(items=items)
        self._inflight = plan
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
        cost = max(self.config.checkpoint_bytes, 1)
        remaining = None if budget is None else budget // cost

        # Candidates in value order: tail/branch/output of every item before any interval.
        wanted: list[tuple[int, int, int, str]] = []  # (rank, item index, boundary, kind)
        # proven sharing first (branch), then what the next turn will likely hit (tail, output)
        rank_of = {"branch": 0, "tail": 1, "output": 2, "step": 3, "unit": 3, "interval": 4}
        for idx, item in enumerate(items):
            ctx = CaptureContext(
                start=item.start,
                end=item.end,
                target_len=len(item.token_ids),
                prompt_len=item.seq.prompt_len,
                unit=self.unit,
                interval=self.interval,
                hit=item.seq.num_cached_tokens,
                branch=item.seq.branch_boundary,
            )
            boundaries = [] if item.is_decode else self.policy.prefill_boundaries(ctx)
            for b, kind in boundaries:
                wanted.append((rank_of.get(kind, 5), idx, b, kind))
            ob = self.policy.output_boundary(ctx)
            if ob and all(b != ob for b, _ in boundaries):
                wanted.append((rank_of["output"], idx, ob, "output"))
        wanted.sort(key=lambda w: (w[0], w[1]))
        with_output = {idx for _, idx, _, kind in wanted if kind == "output"}
        for _, idx, boundary, kind in wanted:
            item = items[idx]
            if remaining is not None and remaining <= 0:
                self.counters["checkpoints.skipped_budget"] += 1
                continue
            if kind == "tail" and self.policy.track_output and idx not in with_output:
                # The tail is published right after the step (a concurrent request with the
                # same prefix can hit it at once), but it may only take a free or a dominated
                # slot: evicting a waiting conversation's live checkpoint for a tail that this
                # request's own output checkpoint will usually dominate is a bad trade (LRU
                # picks the conversation most likely to come back next).
                if not self._capture_published(plan, idx, boundary, kind, max_class=0):
                    continue
            elif kind == "output":
                if not self._capture_tracking(plan, idx, boundary):
                    continue
            elif not self._capture_published(plan, idx, boundary, kind):
                continue
            if remaining is not None:
                remaining -= 1
        plan.captures.sort(key=lambda c: (c.item_index, c.boundary))
        return plan

    def _capture_tracking(self, plan: StepPlan, idx: int, boundary: int) -> bool:
        """Write the state at ``boundary`` into the request's tracking slot (reserved on first use)."""
        item = plan.items[idx]
        seq = item.seq
        slot = seq.tracking_slot
        if slot >= 0 and seq.tracking_boundary and self.slots.num_free_checkpoint > 0:
            # Keep the shallower state too while memory allows: publish it now (the deeper
            # one will demote it) and track into a fresh slot.
            node = self._node_at(seq, seq.tracking_boundary)
            if node is not None and node.checkpoint_slot is None:
                self._attach(node, slot)
                seq.tracking_slot = slot = -1
        if slot < 0:
            slot = self._reserve_slot(SlotState.TRACKING, max_class=1)
            if slot < 0:
                slot = self._take_over_restore_source(seq)
            if slot < 0:
                self.counters["checkpoints.skipped_pool"] += 1
                return False
            item.seq.tracking_slot = slot
        item.seq.tracking_boundary = 0  # being overwritten: invalid until commit
        item.seq.pending_tracking_boundary = max(boundary, item.seq.pending_tracking_boundary)
        if item.is_decode:
            plan.decode_copies.append((item.seq.state_slot, slot))
        else:
            plan.captures.append(Capture(idx, boundary, slot, "output"))
        return True

    def _take_over_restore_source(self, seq: SeqCache) -> int:
        """The slot of the checkpoint ``seq`` resumed from, if nobody else can need it; else -1.

        A conversation's previous checkpoint sits on its own single-child chain: the output
        this request is about to track will dominate it, so it is the one checkpoint it may
        displace even when every other checkpoint is protected.
        """
        node = seq.restored_from
        seq.restored_from = None
        if node is None or node.checkpoint_slot is None or node.ckpt_pins or len(node.children) > 1:
            return -1
        slot = self.tree.detach_checkpoint(node)
        self.counters["checkpoints.evicted"] += 1
        self.slots.set_state(slot, SlotState.TRACKING)
        return slot

    def _capture_published(
        self, plan: StepPlan, idx: int, boundary: int, kind: str, *, max_class: int | None = None
    ) -> bool:
        """Stage a capture into a fresh slot, attached to its node at commit."""
        if max_class is None:
            max_class = 2 if kind == "branch" else 1  # proven sharing may displace anything
        slot = self._reserve_slot(SlotState.RESERVED, max_class=max_class)
        if slot < 0:
            self.counters["checkpoints.skipped_pool"] += 1
            return False
        plan.reserved.append(slot)
        plan.captures.append(Capture(idx, boundary, slot, kind))
        return True

    def commit_step(self, plan: StepPlan) -> None:
        """The step succeeded: publish blocks computed and checkpoints captured."""
        if plan is not self._inflight:
            raise RuntimeError("commit of a plan that is not in flight")
        self._inflight = None
        for seq in plan.restored:
            self._release_restore(seq)
            self.counters["checkpoints.restored"] += 1
        for item in plan.items:
            self.publish(item.seq, item.token_ids, item.end)
            if item.seq.pending_tracking_boundary:
                item.seq.tracking_boundary = item.seq.pending_tracking_boundary
                item.seq.pending_tracking_boundary = 0
        for cap in plan.captures:
            if cap.tracking:
                continue
            seq = plan.items[cap.item_index].seq
            node = self._node_at(seq, cap.boundary)
            if node is None or node.checkpoint_slot is not None or not self.enabled:
                self.counters["checkpoints.duplicate"] += 1
                self.slots.free_checkpoint(cap.slot)
                continue
            # a divergence point is proven shared by two trajectories
            self._attach(node, cap.slot, protected=cap.kind == "branch")

    def abort_step(self, plan: StepPlan) -> None:
        """The step failed: release its reservations. Its requests must then be freed."""
        if plan is not self._inflight:
            raise RuntimeError("abort of a plan that is not in flight")
        self._inflight = None
        for slot in plan.reserved:
            self.slots.free_checkpoint(slot)
        for item in plan.items:
            item.seq.pending_tracking_boundary = 0

    def _attach(self, node: Node, slot: int, *, protected: bool = False) -> None:
        """Publish ``slot`` as ``node``'s checkpoint and demote the ones it dominates.

        A checkpoint on the single-child chain just above ``node`` can only serve a prompt
        that diverges inside that chain; the new, deeper one serves every prompt that
        continues it (the next chat turn, the next agent step). So the shallower ones go to
        the front of the checkpoint-eviction order — they stay usable until memory is short.
        A branching node's checkpoint is where known trajectories part: it is kept.
        """
        self.slots.set_state(slot, SlotState.ATTACHED)
        self.tree.attach_checkpoint(node, slot, protected=protected)
        self.counters["checkpoints.stored"] += 1
        above = node.parent
        while above is not None and above is not self.tree.root and len(above.children) == 1:
            if above.checkpoint_slot is not None:
                self.tree.demote_checkpoint(above)
            above = above.parent

    def _release_restore(self, seq: SeqCache) -> None:
        if seq.restore_node is not None:
            self.tree.unpin_checkpoint(seq.restore_node)
            seq.restored_from = seq.restore_node
            seq.restore_node = None

    def _node_at(self, seq: SeqCache, boundary: int) -> Node | None:
        depth = boundary // self.block_size
        return seq.nodes[depth - 1] if 0 < depth <= len(seq.nodes) else None

    def publish(self, seq: SeqCache, token_ids: Sequence[int], num_computed: int) -> None:
        """Insert the request's newly full, computed blocks into the tree (and pin them)."""
        if not self.enabled:
            return
        hashes = self.extend_hashes(token_ids, seq.salt, seq.hashes)
        for i in range(len(seq.nodes), num_computed // self.block_size):
            parent = seq.nodes[-1] if seq.nodes else self.tree.root
            key = hashes[i]
            node = parent.children.get(key)
            if node is not None:
                # Same prefix already cached (computed by another request): share it and
                # return our duplicate block.
                self.blocks.free(seq.block_table[i])
                seq.block_table[i] = node.block_id
                self.tree.touch(node)
            else:
                node = self.tree.insert(parent, key, seq.block_table[i])
            self.tree.pin(node)
            seq.nodes.append(node)

    # ------------------------------------------------------------------ end of a request
    def free(self, seq: SeqCache, *, publish_output: bool = True) -> None:
        """Release everything the request holds; its published blocks stay cached."""
        if self.active.get(seq.request_id) is not seq:
            raise RuntimeError(f"free of unknown request {seq.request_id!r}")
        if self._inflight is not None and any(it.seq is seq for it in self._inflight.items):
            raise RuntimeError("free of a request in the in-flight step")
        del self.active[seq.request_id]
        self._release_restore(seq)
        for h in seq.hashes[: seq.num_inflight]:
            left = self._inflight_hashes[h] - 1
            if left:
                self._inflight_hashes[h] = left
            else:
                del self._inflight_hashes[h]
        seq.num_inflight = 0
        if seq.tracking_slot >= 0:
            node = self._node_at(seq, seq.tracking_boundary) if publish_output else None
            if node is not None and node.checkpoint_slot is None:
                self._attach(node, seq.tracking_slot)
            else:
                self.slots.free_checkpoint(seq.tracking_slot)
            seq.tracking_slot = -1
        for node in seq.nodes:
            self.tree.unpin(node)
        for block_id in seq.block_table[len(seq.nodes) :]:
            self.blocks.free(block_id)
        seq.nodes = []
        seq.block_table = []
        if seq.state_slot >= 0:
            self.slots.free_live(seq.state_slot)
            seq.state_slot = -1

    # ------------------------------------------------------------------ reporting
    def usage(self) -> dict[str, int | float]:
        """Pool occupancy; O(1), so it can be sampled after every step."""
        total = self.blocks.num_blocks
        free = self.blocks.num_free
        used_ckpt = self.slots.num_checkpoint - self.slots.num_free_checkpoint
        return {
            "kv.total_blocks": total,
            "kv.free_blocks": free,
            "kv.cached_blocks": self.tree.num_nodes,
            "kv.pinned_blocks": self.tree.num_pinned,
            "kv.usage": (total - free) / total,
            "checkpoints.slots": self.slots.num_checkpoint,
            "checkpoints.used_slots": used_ckpt,
            "checkpoints.attached": self.tree.num_checkpoints,
            "checkpoints.bytes_used": used_ckpt * self.config.checkpoint_bytes,
            "live_slots.total": self.slots.num_live,
            "live_slots.used": self.slots.num_live - self.slots.num_free_live,
        }

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.counters)
        q = self.counters["prefix_cache.query_tokens"]
        out["prefix_cache.hit_rate"] = self.counters["prefix_cache.hit_tokens"] / q if q else 0.0
        out.update(self.usage())
        return out

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Assert every block, slot and ref count is accounted for exactly once."""
        bs = self.block_size
        nodes = list(self.tree.nodes())
        assert len(nodes) == self.tree.num_nodes, "node count drift"
        assert self.tree.num_pinned == sum(1 for n in nodes if n.ref_count > 0), "pinned count drift"
        assert self.tree.num_checkpoints == sum(1 for n in nodes if n.checkpoint_slot is not None), (
            "ckpt count drift"
        )
        owner: dict[int, str] = {}

        def claim(block_id: int, who: str) -> None:
            assert 0 <= block_id < self.blocks.num_blocks, f"bad block id {block_id} ({who})"
            assert block_id not in owner, f"block {block_id} owned by {owner[block_id]} and {who}"
            owner[block_id] = who

        for b in self.blocks.free_ids():
            claim(b, "free")
        refs: dict[int, int] = {}
        ckpt_pins: dict[int, int] = {}
        for node in nodes:
            claim(node.block_id, "tree")
            parent = node.parent
            assert parent is not None and parent.children.get(node.key) is node, f"{node} detached"
            assert node.depth == parent.depth + 1, f"{node} depth"
            if node.checkpoint_slot is not None:
                assert self.has_gdn, "checkpoint on a model without GDN layers"
                assert (node.depth * bs) % self.unit == 0, f"{node} checkpoint off a unit boundary"
        for seq in self.active.values():
            assert len(seq.block_table) >= len(seq.nodes)
            prev: Node = self.tree.root
            for i, node in enumerate(seq.nodes):
                assert node.parent is prev, f"{seq.request_id}: path broken at block {i}"
                assert seq.block_table[i] == node.block_id, f"{seq.request_id}: block table != path"
                refs[id(node)] = refs.get(id(node), 0) + 1
                prev = node
            for b in seq.block_table[len(seq.nodes) :]:
                claim(b, f"request {seq.request_id}")
            if seq.restore_node is not None:
                ckpt_pins[id(seq.restore_node)] = ckpt_pins.get(id(seq.restore_node), 0) + 1
                assert seq.restore_node.checkpoint_slot is not None, "restore source lost its checkpoint"
        inflight: dict[int, int] = {}
        for seq in self.active.values():
            for h in seq.hashes[: seq.num_inflight]:
                inflight[h] = inflight.get(h, 0) + 1
        assert inflight == self._inflight_hashes, "in-flight prompt hash counts drift"
        assert len(owner) == self.blocks.num_blocks, (
            f"{self.blocks.num_blocks - len(owner)} KV blocks leaked (neither free, cached nor owned)"
        )
        for node in nodes:
            assert node.ref_count == refs.get(id(node), 0), f"{node}: ref_count {node.ref_count} != pins"
            assert node.ckpt_pins == ckpt_pins.get(id(node), 0), f"{node}: ckpt_pins drift"

        # live slots: exactly the active requests'
        live = sorted(s.state_slot for s in self.active.values() if s.state_slot >= 0)
        assert live == sorted(self.slots.live_in_use()), (
            f"live slots {live} != in use {self.slots.live_in_use()}"
        )
        if self.has_gdn:
            assert all(s.state_slot >= 0 for s in self.active.values()), "active request without live slot"
        # checkpoint slots: free / reserved / attached / tracking, each exactly once
        attached = {n.checkpoint_slot for n in nodes if n.checkpoint_slot is not None}
        assert len(attached) == sum(1 for n in nodes if n.checkpoint_slot is not None), "slot on two nodes"
        tracking = [s.tracking_slot for s in self.active.values() if s.tracking_slot >= 0]
        assert len(set(tracking)) == len(tracking), "tracking slot shared"
        reserved = set(self._inflight.reserved) if self._inflight else set()
        for slot, state in self.slots.ckpt_state.items():
            expected = (
                SlotState.ATTACHED
                if slot in attached
                else SlotState.TRACKING
                if slot in tracking
                else SlotState.RESERVED
                if slot in reserved
                else SlotState.FREE
            )
            assert state is expected, f"checkpoint slot {slot} is {state.value}, expected {expected.value}"
        assert self.slots.num_free_checkpoint == self.slots.count(SlotState.FREE), "free list drift"
