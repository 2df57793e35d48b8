"""``v1`` checkpoint eviction: classes dominated < speculative < proven, LRU within a class.

A capture may displace only the classes its kind outranks (``CaptureKind.may_evict``,
further restricted for a tail whose request tracks an output: ``Want.max_class``). A branch
capture, or a checkpoint restored from, is *proven*; a fresh tail or output *speculative*;
a checkpoint with a deeper one below it on a single-child chain *dominated* (it serves only
prompts diverging inside that chain). Victims come from a lazily-invalidated heap: an entry
is valid only while its recorded key is the node's current one. Per-node state:
``V1State`` in ``Node.policy_state``. The value model (``value_eviction.py``) is the
default; this stays for comparison (``docs/cache.md``). Torch-free.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable

from deltaserve.cache.eviction import CheckpointEviction, EvictionParams, Want
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.types import CaptureKind, CheckpointClass, SeqCache

# Subtracted from a dominated checkpoint's access stamp: it sorts before every live one,
# and dominated checkpoints keep their LRU order among themselves.
_DEMOTED = 1 << 60


class V1State:
    """A checkpoint's ``v1`` bookkeeping: its LRU stamp (negative: dominated) and class."""

    __slots__ = ("last_access", "protected")

    def __init__(self, last_access: int, protected: bool) -> None:
        self.last_access = last_access
        self.protected = protected  # proven shared: restored from, or taken at a divergence


class V1Eviction(CheckpointEviction):
    """Dominated < speculative < proven, LRU within a class (see the module docstring)."""

    name = "v1"

    def __init__(self, tree: RadixTree, params: EvictionParams) -> None:
        super().__init__(tree, params)
        self._clock = itertools.count(1)
        self._heap: list[tuple[tuple[int, int], int, Node]] = []
        self._tie = itertools.count()

    @staticmethod
    def ckpt_key(node: Node) -> tuple[int, int]:
        state: V1State = node.policy_state
        if state.last_access < 0:
            return (CheckpointClass.DOMINATED, state.last_access)
        cls = CheckpointClass.PROVEN if state.protected else CheckpointClass.SPECULATIVE
        return (cls, state.last_access)

    @staticmethod
    def is_demoted(node: Node) -> bool:
        """Dominated by a deeper checkpoint below it on a single-child chain."""
        return node.policy_state.last_access < 0

    def worth(self, node: Node) -> float:
        """How recently the checkpoint was used."""
        return float(node.policy_state.last_access)

    def _push(self, node: Node) -> None:
        if node.checkpoint_slot is not None and node.ckpt_pins == 0:
            heapq.heappush(self._heap, (self.ckpt_key(node), next(self._tie), node))

    def on_attach(self, node: Node, kind: CaptureKind, history: int | None = None) -> None:
        """Fresh in LRU order; a branch is proven. The checkpoints on the single-child chain
        just above ``node`` are dominated: they serve only prompts diverging inside that chain,
        the new one serves every prompt continuing it. They go to the front of the order
        (still usable until memory is short). A branching node's checkpoint is kept."""
        node.policy_state = V1State(next(self._clock), kind is CaptureKind.BRANCH)
        self._push(node)
        above = node.parent
        while above is not None and above is not self.tree.root and len(above.children) == 1:
            if above.checkpoint_slot is not None and above.policy_state.last_access > 0:
                above.policy_state.last_access -= _DEMOTED
                self._push(above)
            above = above.parent

    def on_hit(self, node: Node) -> None:
        state: V1State = node.policy_state
        state.last_access = next(self._clock)
        state.protected = True
        self._push(node)

    def on_unpin(self, node: Node) -> None:
        if node.ckpt_pins == 0:
            self._push(node)

    def _peek(self) -> Node | None:
        while self._heap:
            key, _, node = self._heap[0]
            valid = (
                node.checkpoint_slot is not None
                and node.ckpt_pins == 0
                and key == self.ckpt_key(node)
                and node.parent is not None
            )
            if valid:
                return node
            heapq.heappop(self._heap)
        return None

    def victim(
        self,
        want: Want,
        residents: Iterable[Node],
        trackers: Iterable[SeqCache] = (),
        host_floor: float = math.inf,
    ) -> tuple[Node | SeqCache | None, str]:
        node = self._peek()
        if node is None:
            return None, "pool"
        # A resident of a class ``want`` may not displace still goes when the host tier
        # keeps it (its recency beats the host's floor): it moves rather than being lost.
        if self.ckpt_key(node)[0] > want.max_class and self.worth(node) <= host_floor:
            return None, "pool"
        return node, ""

    def may_take_over(self, source: Node | None) -> bool:
        """The checkpoint the request resumed from, if nobody else can need it (no pending
        restore, at most one child). A conversation's previous checkpoint sits on its own
        single-child chain: the output the request is about to track will dominate it, so
        it is the one checkpoint it may displace even when every other one is protected."""
        return (
            source is not None
            and source.checkpoint_slot is not None
            and not source.ckpt_pins
            and len(source.children) <= 1
        )

    def compact(self, num_nodes: int) -> None:
        if len(self._heap) > 4 * (num_nodes + 64):
            self._heap = [e for e in self._heap if e[2].checkpoint_slot is not None]
            heapq.heapify(self._heap)
