"""``value`` checkpoint eviction (the default): hit density x compute saved / bytes.

Every resident checkpoint — and through it the KV leaf it ends — is worth

    value = hit density(class, age) x compute saved(depth over its base) / bytes

* *compute saved* (``CostModel``): a hit falls back, were the checkpoint gone, to the
  deepest checkpoint above it (its *base*), so it is worth ``cost(d) - cost(base)``.
* *hit density* (``cache/reuse.py``): per class — the capture kind (and path history)
  until the checkpoint serves a hit, then ``hit1`` / ``hit2`` — at its age in admissions
  (restarting at a hit).
* A capture takes a free slot, or replaces the weakest evictable resident — a published
  checkpoint, or a decoding request's tracking slot valued as its output after the
  remaining decode — if it is worth more; else it is skipped (``checkpoints.skipped_value``).
  Where that resident is a tail with KV below it and the older tail above it is one it
  dominates, the older tail goes in its place (the same slot; the newer one is the hit).
  KV eviction drops checkpoint-less leaves first (LRU: no hit can end there), then the leaf
  whose checkpoint is worth least.
* A checkpoint where two or more running requests fork does not age while they run: it is
  the fallback of whichever of them is continued (a tree search's parent).
* A checkpoint a waiting request would restore from (``expect_hits``) has a density of at
  least ``1 / due``: its hit is certain, ``due`` admissions away (``scheduler/awaited.py``).
* Cyclic reuse larger than the pool does not churn: a new capture has age 0, a resident
  near its usual reuse age has a higher density; one past every usual reuse age decays to
  zero and goes.

Per-node state: ``ValueState`` in ``Node.policy_state``. Details and measurements:
``docs/cache.md``. Torch-free; O(1) per event except victim selection (O(resident
checkpoints + trackers)).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from deltaserve.cache.eviction import CheckpointEviction, CostModel, EvictionParams, T, Want
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.reuse import HIT_CLASSES, ReuseLearner
from deltaserve.cache.types import CaptureKind, SeqCache


class ValueState:
    """A checkpoint's value bookkeeping."""

    __slots__ = ("kind", "history", "hits", "since", "base")

    def __init__(self, kind: CaptureKind, history: int | None, since: int, base: Node | None) -> None:
        self.kind = kind  # the capture kind
        self.history = history  # its request's path history (None: unknown)
        self.hits = 0  # hits served
        self.since = since  # when its current reuse class began (admissions)
        self.base = base  # the nearest checkpoint above it (when it was valued)


class ValueEviction(CheckpointEviction):
    """Hit density x compute saved / bytes (see the module docstring)."""

    name = "value"
    values_awaited_hits = True
    per_byte = True

    def __init__(self, tree: RadixTree, params: EvictionParams, learner: ReuseLearner | None = None) -> None:
        super().__init__(tree, params)
        self.awaited: dict[Node, int] = {}  # ``expect_hits``: node -> admissions until its hit
        self.block_size = params.block_size
        self.unit_blocks = params.unit_blocks
        self.bytes = max(params.checkpoint_bytes, 1)
        self.kv_block_bytes = params.kv_block_bytes
        self.cost = params.cost
        self.learner = learner or ReuseLearner(capacity=max(1 << 16, 64 * params.num_checkpoint_slots))
        self._serve_memo: dict[str, float] = {}  # class -> reuse probability, at ``_serve_at``
        self._serve_at = -1

    def _class(self, state: ValueState) -> str:
        if state.hits:
            return HIT_CLASSES[min(state.hits, 2) - 1]
        return self.learner.label(state.kind, state.history)

    def saved(self, depth: int, base: int) -> float:
        """Compute a hit at ``depth`` saves over falling back to the checkpoint at ``base``."""
        return self.cost.saved(depth) - self.cost.saved(base)

    @staticmethod
    def checkpoint_above(node: Node) -> Node | None:
        above = node.parent
        while above is not None and above.checkpoint_slot is None:
            above = above.parent
        return above if above is not None and above.parent is not None else None

    def _base(self, node: Node) -> int:
        """Depth (tokens) of the nearest checkpoint above ``node``: found at attach, found again
        only when that one is gone (a checkpoint added in between is not seen)."""
        state: ValueState = node.policy_state
        base = state.base
        if base is not None and (base.checkpoint_slot is None or base.parent is None):
            base = state.base = self.checkpoint_above(node)
        return base.depth * self.block_size if base is not None else 0

    def value(self, node: Node) -> float:
        # A checkpoint where running requests fork does not age: it is their shared fallback
        # — were the state the one continued goes on to produce not kept (a tree search's
        # expanded child, whichever it is), its continuation resumes here. Once fewer than
        # two run below it, its age counts from its last hit again. Forks of running
        # requests only: a conversation's older tail forks from its own finished output
        # (rewritten replies) and is dominated by the tail its running turn captures
        # (counting it too churns a lock-step round-robin: docs/cache.md).
        state: ValueState = node.policy_state
        age = 0 if self._shared_by_running(node) else self.learner.now - state.since
        density = self.learner.density(self._class(state), age)
        due = self.awaited.get(node)
        if due is not None:  # a waiting request restores from it once admitted: a certain hit
            density = max(density, 1.0 / due)
        depth, base = node.depth * self.block_size, self._base(node)
        # with one budget a leaf checkpoint also holds the KV only it keeps reachable
        held = self.bytes + (0 if node.children else self._kv_bytes(depth - base))
        return density * self.saved(depth, base) / held

    def _kv_bytes(self, tokens: int) -> int:
        """KV bytes of ``tokens`` (whole blocks) when one budget holds KV and checkpoints, else 0."""
        return self.kv_block_bytes * (tokens // self.block_size)

    def worth(self, node: Node) -> float:
        return self.value(node)

    def expect_hits(self, due: dict[Node, int]) -> None:
        self.awaited = due

    def likely_to_serve(self, node: Node) -> bool:
        """The learner credits checkpoints of ``node``'s class with a hit more often than not."""
        return self._reuse(node) >= 0.5

    def dominates(self, deeper: Node, node: Node) -> bool:
        """``deeper`` serves more often than not, or at least as often as ``node``'s class: a
        conversation whose replies come back verbatim learns its outputs serve and its older
        tails do not (the deeper checkpoint is credited first), though a reply may never
        come; one whose replies come back rewritten learns the reverse."""
        p = self._reuse(deeper)
        return p >= 0.5 or p >= self._reuse(node)

    def _reuse(self, node: Node) -> float:
        """The learned reuse probability of ``node``'s class, 1 when it is not valued here
        (memoised per admission: the estimate moves only as admissions are observed)."""
        state: ValueState | None = node.policy_state
        if state is None:
            return 1.0
        learner = self.learner
        if self._serve_at != learner.now:
            self._serve_memo.clear()
            self._serve_at = learner.now
        label = self._class(state)
        p = self._serve_memo.get(label)
        if p is None:
            p = self._serve_memo[label] = learner.reuse_probability(label)
        return p

    def _shared_by_running(self, node: Node) -> bool:
        """At least two running requests fork within one unit below ``node``: its checkpoint
        is the deepest one they share (a branch capture sits at the unit boundary below a
        divergence)."""
        if node.ref_count < 2:
            return False
        for _ in range(self.unit_blocks):
            children = node.children
            if len(children) != 1:
                return sum(1 for c in children.values() if c.ref_count) >= 2
            node = next(iter(children.values()))
        return False

    def want_value(self, want: Want) -> float:
        # an output is tracked until its request finishes: the slot is held that long first
        delay = self.learner.track_time if want.kind is CaptureKind.OUTPUT else 0.0
        density = self.learner.density(self.learner.label(want.kind, want.history), 0, delay)
        held = self.bytes + self._kv_bytes(want.boundary - want.base)
        return density * self.saved(want.boundary, want.base) / held

    def tracker_value(self, seq: SeqCache) -> float:
        """A tracking slot's worth: its output at the tracked boundary, once the request ends."""
        learner = self.learner
        left = max(learner.track_time - (learner.now - seq.tracking_since), 0.0)
        density = learner.density(learner.label(CaptureKind.OUTPUT, seq.history), 0, left)
        held = self.bytes + self._kv_bytes(seq.tracking_boundary - seq.tracking_base)
        return density * self.saved(seq.tracking_boundary, seq.tracking_base) / held

    # -- events --------------------------------------------------------------------------
    def on_attach(self, node: Node, kind: CaptureKind, history: int | None = None) -> None:
        node.policy_state = ValueState(kind, history, self.learner.now, self.checkpoint_above(node))
        self.learner.kept_at(node.key, kind, history)

    def on_hit(self, node: Node) -> None:
        state: ValueState = node.policy_state
        state.hits += 1
        state.since = self.learner.now

    def on_unpin(self, node: Node) -> None:
        return None  # values are computed when needed: nothing is queued

    def on_propose(self, key: int, kind: CaptureKind, history: int | None) -> None:
        self.learner.register(key, kind, history)

    def observe(self, hashes: Sequence[int], limit_blocks: int, stride: int) -> int | None:
        return self.learner.observe(hashes, limit_blocks, stride)

    def on_track(self, seq: SeqCache) -> None:
        seq.tracking_since = self.learner.now

    def on_untrack(self, seq: SeqCache, finished: bool) -> None:
        # how long a tracking slot is held before its output can serve
        if finished:
            self.learner.tracked(self.learner.now - seq.tracking_since)

    def set_cost(self, cost: CostModel) -> None:
        self.cost = cost

    # -- choices -------------------------------------------------------------------------
    def order(self, wants: list[tuple[Want, T]]) -> list[tuple[Want, T]]:
        return sorted(wants, key=lambda w: -self.want_value(w[0]))

    def victim(
        self,
        want: Want,
        residents: Iterable[Node],
        trackers: Iterable[SeqCache] = (),
        host_floor: float = math.inf,
    ) -> tuple[Node | SeqCache | None, str]:
        """The least valuable evictable resident — or tracking slot: a decoding request's
        output, valued as an output capture at its current boundary, not being written by
        the step in flight — if ``want`` is worth more."""
        best: Node | SeqCache | None = None
        best_value = math.inf
        for node in residents:
            if self._held_for_others(node, want):
                continue
            v = self.value(node)
            if v < best_value:
                best, best_value = node, v
        if best is not None:
            best = self._older_tail(best, want)
        node_victim = best  # the weakest published checkpoint (it can move to the host)
        for seq in trackers:
            if seq.pending_tracking_boundary:
                continue
            v = self.tracker_value(seq)
            if v < best_value:
                best, best_value = seq, v
        if best is None:
            return None, "pool"
        worth = self.want_value(want)
        if worth <= best_value:
            # Not worth more than the weakest here, but the host tier would keep it: with one
            # host budget the weakest published checkpoint moves down to make room, even when
            # a tracking slot is weaker still (a tracker cannot move, and skipping loses the
            # capture outright). A fixed host checkpoint pool is the wall itself: there the
            # extra demotions only churn it, so a weaker tracker still means a skip.
            if worth > host_floor and (
                isinstance(best, Node) or (self.displace_to_host and node_victim is not None)
            ):
                return node_victim, ""
            return None, "value"
        return best, ""

    @staticmethod
    def _held_for_others(node: Node, want: Want) -> bool:
        """``node``'s checkpoint is pinned by someone other than the capture itself (a capture's
        own source, pinned once by it, may give way to it)."""
        return bool(node.ckpt_pins) and not (node is want.own and node.ckpt_pins == 1)

    def _older_tail(self, node: Node, want: Want) -> Node:
        """The tail checkpoint above tail ``node`` in its place, where ``node`` has KV below it
        (its conversation decoding a reply or gone on past it) and dominates that older tail:
        the older one is the next to go anyway, and dropping it first frees the same slot
        while the conversation keeps its deepest fallback (dropping the newer one loses its
        whole turn, and often the older tail later too: docs/cache.md)."""
        state: ValueState = node.policy_state
        base = state.base
        if (
            not node.children
            or state.kind is not CaptureKind.TAIL
            or base is None
            or base.checkpoint_slot is None
            or base.parent is None
            or base in self.awaited
            or self._held_for_others(base, want)
        ):
            return node
        base_state: ValueState | None = base.policy_state
        if base_state is None or base_state.kind is not CaptureKind.TAIL or not self.dominates(node, base):
            return node
        return base

    def kv_victim(self, residents: Iterable[Node]) -> Node | None:
        top = self.tree.peek_evictable_leaf()
        if top is None or top.checkpoint_slot is None:
            return top
        is_leaf = self.tree.is_evictable_leaf
        return min((n for n in residents if is_leaf(n)), key=self.value, default=top)

    def stats(self) -> dict[str, float]:
        learner = self.learner
        return {
            f"checkpoints.reuse.{label}": round(learner.reuse_probability(label), 4)
            for label in ("branch", "tail", "output", "interval", *HIT_CLASSES)
        }
