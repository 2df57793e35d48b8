"""The checkpoint side of the cache: GDN state slots, published checkpoints, eviction.

Every checkpoint slot is exactly one of FREE, RESERVED (staged for the in-flight step),
ATTACHED (one tree node's checkpoint) or TRACKING (a decoding request's output slot);
live slots belong one-to-one to active requests. Which checkpoint makes room for a new one
is the eviction strategy's choice (``cache/eviction.py``); what it gives up moves to the
host tier when that takes it. ``check_integrity`` proves the accounting. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from deltaserve.cache.disk_link import DiskLink
from deltaserve.cache.eviction import CheckpointEviction, Want
from deltaserve.cache.host_tier import HostTier
from deltaserve.cache.prefix_index import PrefixIndex
from deltaserve.cache.radix_tree import Node
from deltaserve.cache.state_pool import SlotState, StatePool
from deltaserve.cache.types import (
    Capture,
    CaptureCandidate,
    CaptureKind,
    CheckpointClass,
    SeqCache,
    StepPlan,
    Tier,
    TransferKind,
)


class CheckpointStore:
    def __init__(
        self,
        num_live: int,
        num_checkpoint: int,
        kv: PrefixIndex,
        eviction: CheckpointEviction,
        host: HostTier,
        checkpoint_bytes: int,
        grow: Callable[[], bool] | None = None,
        on_skip: Callable[[int, int], None] | None = None,
        disk: DiskLink | None = None,
    ) -> None:
        self.slots = StatePool(num_live, num_checkpoint)
        # shared budget: makes one more free slot out of bytes nobody values (a free page, free
        # or unreachable KV); tried before a resident is displaced
        self.grow = grow
        # shared budget: a capture that found no room (key, depth in blocks), a "ghost" whose
        # later hits would have needed more checkpoint memory
        self.on_skip = on_skip
        # every declined capture, by the key of the block it would end (the loss attribution)
        self.note_skip: Callable[[int], None] | None = None
        self.kv = kv
        self.tree = kv.tree
        self.eviction = eviction
        self.host = host  # where evicted checkpoints go (when it takes them)
        self.checkpoint_bytes = checkpoint_bytes
        # the disk tier (``cache/disk_link.py``) hears of a checkpoint published, and of one
        # evicted from the device that the host did not take (slot detached, bytes intact)
        self.disk = disk if disk is not None else DiskLink()
        self.attached: dict[int, Node] = {}  # slot -> node holding it
        self.trackers: dict[int, SeqCache] = {}  # tracking slot -> its decoding request
        self.counters: dict[str, int] = dict.fromkeys(
            ("checkpoints.stored", "checkpoints.skipped_budget", "checkpoints.skipped_pool",
             "checkpoints.skipped_value", "checkpoints.evicted"), 0)  # fmt: skip

    @property
    def residents(self) -> Iterable[Node]:
        return self.attached.values()

    # ------------------------------------------------------------------ publish / drop
    def attach(self, node: Node, slot: int, kind: CaptureKind, history: int | None = None) -> None:
        """Publish ``slot`` (reserved or tracking) as ``node``'s checkpoint; whole or not at
        all (a raise leaves the slot as it was)."""
        state = self.slots.ckpt_state[slot]
        self.slots.set_state(slot, SlotState.ATTACHED)
        try:
            self.tree.attach_checkpoint(node, slot)
            try:
                self.attached[slot] = node
                self.eviction.on_attach(node, kind, history)
            except BaseException:
                self.attached.pop(slot, None)
                # the node's pins, if any, are its host checkpoint's: set aside to detach
                pins, node.ckpt_pins = node.ckpt_pins, 0
                self.tree.detach_checkpoint(node)
                node.ckpt_pins = pins
                raise
        except BaseException:
            self.slots.set_state(slot, state)
            raise
        self.counters["checkpoints.stored"] += 1
        self.disk.note_checkpoint(node)

    def detach(self, node: Node) -> int:
        """Unpublish ``node``'s checkpoint; its slot stays in use (the caller's)."""
        slot = self.tree.detach_checkpoint(node)
        del self.attached[slot]
        self.counters["checkpoints.evicted"] += 1
        return slot

    def drop(self, node: Node) -> None:
        """Drop ``node``'s checkpoint and free its slot."""
        self.slots.free_checkpoint(self.detach(node))

    def evict(self, node: Node) -> None:
        """Evict ``node``'s checkpoint from the device: demoted to the host tier when it
        takes it (the save runs before this step reuses the slot), else dropped."""
        slot = self.detach(node)
        if not self.host.demote_checkpoint(node, slot):
            self.disk.write_back(node, Tier.DEVICE, slot)
        self.slots.free_checkpoint(slot)

    # ------------------------------------------------------------------ slots
    def reserve(self, state: SlotState, want: Want) -> tuple[int, str]:
        """A slot in ``state`` for ``want``: a free one, or the slot of the checkpoint the
        eviction strategy gives up. ``(slot, "")``; ``(slot, "own")`` when it is the slot of
        the request's own pending restore source (whose restore the caller releases: the
        copy out of it runs before the step writes the capture); ``(-1, reason)`` when there
        is none (reason ``pool`` or ``value``; the caller counts the skip)."""
        if self.slots.num_free_checkpoint > 0 or (self.grow is not None and self.grow()):
            return self.slots.allocate_checkpoint(state), ""
        node, reason = self.eviction.victim(want, self.residents, self.trackers.values(), self.host.floor())
        if node is None:
            return -1, reason
        if isinstance(node, SeqCache):  # a decoding request's tracked output gives way
            slot = node.tracking_slot
            boundary = node.tracking_boundary // self.kv.block_size
            if self.tree.on_checkpoint_gone is not None and 0 < boundary <= len(node.hashes):
                self.tree.on_checkpoint_gone(node.hashes[boundary - 1])  # an output, gone
            self.untrack(node, finished=False)
            node.tracking_boundary = 0
            self.slots.set_state(slot, state)
            self.counters["checkpoints.evicted"] += 1
            return slot, ""
        if node is want.own and node.ckpt_pins:
            self.tree.unpin_checkpoint(node)
            slot = self.detach(node)
            self.slots.set_state(slot, state)
            return slot, "own"
        self.evict(node)
        return self.slots.allocate_checkpoint(state), ""

    def track(self, seq: SeqCache, slot: int) -> None:
        seq.tracking_slot = slot
        self.trackers[slot] = seq
        self.eviction.on_track(seq)

    def untrack(self, seq: SeqCache, *, finished: bool = True) -> None:
        """``seq`` stops tracking; ``finished``: because its output is done."""
        del self.trackers[seq.tracking_slot]
        seq.tracking_slot = -1
        self.eviction.on_untrack(seq, finished)

    def take_over(self, node: Node | None, state: SlotState) -> int:
        """The slot of the checkpoint a request resumed from, when the eviction strategy
        lets its output take it (``CheckpointEviction.may_take_over``); else -1."""
        if node is None or not self.eviction.may_take_over(node):
            return -1
        slot = self.detach(node)
        self.slots.set_state(slot, state)
        return slot

    # ------------------------------------------------------------------ restores
    def pin_source(self, node: Node) -> None:
        """A request will restore from ``node``'s checkpoint (either tier): a hit, pinned
        until the copy has run."""
        self.tree.pin_checkpoint(node)
        self.eviction.on_hit(node)

    def unpin_source(self, node: Node) -> None:
        self.tree.unpin_checkpoint(node)
        try:
            self.eviction.on_unpin(node)
        except BaseException:  # whole or not at all: the pin stays
            self.tree.pin_checkpoint(node)
            raise

    def pin_restore(self, seq: SeqCache, node: Node) -> None:
        """``seq`` resumes from ``node``'s device checkpoint: pinned until the copy has run."""
        self.pin_source(node)
        seq.restore_node = node

    def release_restore(self, seq: SeqCache) -> None:
        node = seq.restore_node
        if node is not None:
            self.unpin_source(node)
            seq.restored_from = node
            seq.restore_node = None

    # ------------------------------------------------------------------ staging
    def stage(self, plan: StepPlan, idx: int, want: Want) -> bool:
        """Give ``want`` (a capture of item ``idx``) a slot in ``plan``; False if skipped."""
        item = plan.items[idx]
        seq = item.seq
        if want.kind is not CaptureKind.OUTPUT:
            slot = self._reserve(seq, SlotState.RESERVED, want)
            if slot < 0:
                return False
            plan.reserved.append(slot)
            plan.captures.append(Capture(idx, want.boundary, slot, want.kind))
            return True
        # an output goes into the request's tracking slot, reserved on first use
        slot = seq.tracking_slot
        if slot >= 0 and seq.tracking_boundary and self.slots.num_free_checkpoint > 0:
            # Keep the shallower state too while memory allows: publish it now (the deeper
            # one will demote it) and track into a fresh slot.
            node = self.kv.node_at(seq, seq.tracking_boundary)
            if node is not None and node.checkpoint_slot is None:
                self.untrack(seq, finished=False)
                self.attach(node, slot, CaptureKind.OUTPUT, seq.history)
                slot = -1
        if slot < 0:
            slot = self._reserve(seq, SlotState.TRACKING, want)
            if slot < 0:
                return False
            self.track(seq, slot)
            seq.tracking_base = want.base
        seq.tracking_boundary = 0  # being overwritten: invalid until commit
        seq.pending_tracking_boundary = max(want.boundary, seq.pending_tracking_boundary)
        if item.is_decode:
            plan.decode_copies.append((seq.state_slot, slot))
        else:
            plan.captures.append(Capture(idx, want.boundary, slot, CaptureKind.OUTPUT))
        return True

    def stage_captures(
        self,
        plan: StepPlan,
        candidates: Sequence[CaptureCandidate],
        remaining: int | None,
        *,
        shield_tails: bool,
    ) -> None:
        """Stage a step's proposed captures, most valuable first, while the per-step budget
        (``remaining`` captures; None: unbounded) lasts; what finds no slot is skipped.
        The eviction strategy hears of every proposal, stored or not."""
        items = plan.items
        eviction = self.eviction
        bs = self.kv.block_size
        with_output = {c.item_index for c in candidates if c.kind is CaptureKind.OUTPUT}
        wants: list[tuple[Want, CaptureCandidate]] = []
        for c in candidates:
            seq = items[c.item_index].seq
            if c.kind is not CaptureKind.OUTPUT:  # (an output is proposed when its request ends)
                eviction.on_propose(seq.hashes[c.boundary // bs - 1], c.kind, seq.history)
            # v1: a tail whose request also tracks an output may only take a free or dominated
            # slot (its own output will usually dominate it; LRU would evict the waiting
            # conversation most likely to come back next)
            shielded = c.kind is CaptureKind.TAIL and shield_tails and c.item_index not in with_output
            max_class = CheckpointClass.DOMINATED if shielded else c.kind.may_evict
            # a capture may take the slot of its pending restore source
            own = seq.restore_node
            base = self.kv.checkpoint_depth_above(seq, c.boundary, skip=own)
            wants.append((Want(c.kind, c.boundary, max_class, own, base, seq.history), c))
        for want, c in self.eviction.order(wants):
            if remaining is not None and remaining <= 0:
                self.counters["checkpoints.skipped_budget"] += 1
                hashes = items[c.item_index].seq.hashes  # (an output's may not reach it yet)
                if self.note_skip is not None and 0 < c.boundary // bs <= len(hashes):
                    self.note_skip(hashes[c.boundary // bs - 1])
            elif self.stage(plan, c.item_index, want) and remaining is not None:
                remaining -= 1
        plan.captures.sort(key=lambda c: (c.item_index, c.boundary))

    def _reserve(self, seq: SeqCache, state: SlotState, want: Want) -> int:
        slot, why = self.reserve(state, want)
        if why == "own":  # the restore copy runs first in this step; nothing else reads it
            seq.restore_node = seq.restored_from = None
        elif slot < 0 and want.kind is CaptureKind.OUTPUT:  # the last resort (v1 only)
            slot = self.take_over(seq.restored_from, state)
            seq.restored_from = None
        if slot < 0:
            self.counters[f"checkpoints.skipped_{why or 'pool'}"] += 1
            depth = want.boundary // self.kv.block_size
            if self.on_skip is not None and 0 < depth <= len(seq.hashes):
                self.on_skip(seq.hashes[depth - 1], depth)
            if self.note_skip is not None and 0 < depth <= len(seq.hashes):
                self.note_skip(seq.hashes[depth - 1])
        return slot

    def end_tracking(self, seq: SeqCache, publish: bool) -> None:
        """The request ends: publish its tracked output (``publish``), else free the slot."""
        if seq.tracking_slot < 0:
            return
        slot = seq.tracking_slot
        self.untrack(seq)
        node = self.kv.node_at(seq, seq.tracking_boundary) if publish else None
        if node is not None and node.checkpoint_slot is None:
            self.attach(node, slot, CaptureKind.OUTPUT, seq.history)
        else:
            self.slots.free_checkpoint(slot)

    def compact(self) -> None:
        self.eviction.compact(self.tree.num_nodes)

    def usage(self) -> dict[str, int | float]:
        slots = self.slots
        used = slots.num_checkpoint - slots.num_free_checkpoint
        return {
            "checkpoints.slots": slots.num_checkpoint,
            "checkpoints.used_slots": used,
            "checkpoints.attached": self.tree.num_checkpoints,
            "checkpoints.bytes_used": used * self.checkpoint_bytes,
            "live_slots.total": slots.num_live,
            "live_slots.used": slots.num_live - slots.num_free_live,
        }

    # ------------------------------------------------------------------ invariants
    def check_integrity(
        self, nodes: list[Node], active: Iterable[SeqCache], reserved: set[int], unit_blocks: int
    ) -> None:
        """Every checkpoint slot in exactly one state; live slots = the active requests'."""
        active = list(active)
        attached = self._check_attached(nodes, unit_blocks)
        self._check_pins(nodes, active)
        self._check_live(active)
        tracking = self._check_trackers(active)
        self._check_slot_states(attached, tracking, reserved)

    def _check_attached(self, nodes: list[Node], unit_blocks: int) -> dict[int, Node]:
        """One node per attached slot, on a unit boundary; the attached map agrees."""
        attached: dict[int, Node] = {}
        for n in nodes:
            if n.checkpoint_slot is not None:
                assert n.checkpoint_slot not in attached, "slot on two nodes"
                attached[n.checkpoint_slot] = n
        assert attached == self.attached, "attached-slot map drift"
        for n in attached.values():
            assert n.depth % unit_blocks == 0, f"{n} checkpoint off a unit boundary"
        return attached

    @staticmethod
    def _check_pins(nodes: list[Node], active: list[SeqCache]) -> None:
        """A checkpoint's pins = the pending restores from it (device or host tier)."""
        pins: dict[int, int] = {}
        for seq in active:
            if seq.restore_node is not None:
                pins[id(seq.restore_node)] = pins.get(id(seq.restore_node), 0) + 1
                assert seq.restore_node.checkpoint_slot is not None, "restore source lost its checkpoint"
            for t in seq.loads:  # a restore from the host tier, pinned until it lands
                if t.kind is TransferKind.STATE_LOAD:
                    pins[id(t.node)] = pins.get(id(t.node), 0) + 1
                    assert t.node.host_slot == t.src, "host restore source lost its checkpoint"
        for n in nodes:
            assert n.ckpt_pins == pins.get(id(n), 0), f"{n}: ckpt_pins drift"

    def _check_live(self, active: list[SeqCache]) -> None:
        live = sorted(s.state_slot for s in active if s.state_slot >= 0)
        in_use = self.slots.live_in_use()
        assert live == sorted(in_use), f"live slots {live} != in use {in_use}"

    def _check_trackers(self, active: list[SeqCache]) -> list[int]:
        """Tracking slots are the active requests', one each; the tracker map agrees."""
        tracking = [s.tracking_slot for s in active if s.tracking_slot >= 0]
        assert len(set(tracking)) == len(tracking), "tracking slot shared"
        assert {s.tracking_slot: s for s in active if s.tracking_slot >= 0} == self.trackers, (
            "tracker map drift"
        )
        return tracking

    def _check_slot_states(self, attached: dict[int, Node], tracking: list[int], reserved: set[int]) -> None:
        """Each checkpoint slot's state is the one its holder implies; the free list agrees."""
        slots = self.slots
        for slot, state in slots.ckpt_state.items():
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
        assert slots.num_free_checkpoint == slots.count(SlotState.FREE), "free list drift"
