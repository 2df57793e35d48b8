"""Radix index of full KV blocks, one node per block, children keyed by chained hash.

A node owns one KV block id (for all full-attention layers) and optionally one
checkpoint slot: the GDN state at the node's end boundary ``depth * block_size``.

Eviction candidates are kept in two lazily-invalidated heaps so that picking a victim is
O(log n) even with hundreds of thousands of nodes (the simulator replays big workloads):

* KV leaves: unpinned nodes without children. Ordered by ``(has_checkpoint, last_access)``:
  a leaf with no checkpoint can never end a hybrid hit, so it goes first.
* Checkpoints: nodes with a checkpoint and no pending restore, LRU.

A heap entry is valid only if its recorded priority still equals the node's current one;
anything else is skipped when popped. Torch-free by design.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

# Subtracted from a demoted checkpoint's access stamp: it sorts before every live one, and
# demoted checkpoints keep their LRU order among themselves.
_DEMOTED = 1 << 60


class Node:
    __slots__ = (
        "key",
        "parent",
        "children",
        "block_id",
        "depth",
        "checkpoint_slot",
        "ref_count",
        "ckpt_pins",
        "last_access",
        "ckpt_last_access",
        "ckpt_protected",
    )

    def __init__(self, key: int, parent: Node | None, block_id: int, depth: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.block_id = block_id
        self.depth = depth  # number of blocks from the root to this node inclusive
        self.checkpoint_slot: int | None = None
        self.ref_count = 0  # running requests pinning this node's KV
        self.ckpt_pins = 0  # pending restores reading this node's checkpoint
        self.last_access = 0
        self.ckpt_last_access = 0
        # proven shared: restored from by a request, or taken at a divergence point
        self.ckpt_protected = False

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, block={self.block_id}, ckpt={self.checkpoint_slot}, ref={self.ref_count})"


class RadixTree:
    def __init__(self) -> None:
        self.root = Node(key=0, parent=None, block_id=-1, depth=0)
        self.num_nodes = 0
        self.num_pinned = 0  # nodes with ref_count > 0 (O(1) usage reporting)
        self.num_checkpoints = 0  # nodes holding a checkpoint
        self._clock = itertools.count(1)
        self._leaf_heap: list[tuple[bool, int, int, Node]] = []
        self._ckpt_heap: list[tuple[tuple[int, int], int, Node]] = []
        self._tie = itertools.count()

    def tick(self) -> int:
        return next(self._clock)

    # -- lookup / insert / remove -------------------------------------------------------
    def match(self, hashes: list[int]) -> list[Node]:
        """Longest path from the root whose keys equal ``hashes[:k]``."""
        path: list[Node] = []
        node = self.root
        for h in hashes:
            child = node.children.get(h)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def insert(self, parent: Node, key: int, block_id: int) -> Node:
        if key in parent.children:
            raise RuntimeError("insert of an existing key")
        node = Node(key, parent, block_id, parent.depth + 1)
        node.last_access = self.tick()
        parent.children[key] = node
        self.num_nodes += 1
        self._maybe_push_leaf(node)
        return node

    def remove_leaf(self, node: Node) -> None:
        if node.children or node.ref_count or node.parent is None:
            raise RuntimeError(f"cannot remove {node}")
        parent = node.parent
        del parent.children[node.key]
        node.parent = None
        self.num_nodes -= 1
        if parent is not self.root:
            self._maybe_push_leaf(parent)

    def touch(self, node: Node) -> None:
        node.last_access = self.tick()
        self._maybe_push_leaf(node)

    # -- pins ----------------------------------------------------------------------------
    def pin(self, node: Node) -> None:
        node.ref_count += 1
        if node.ref_count == 1:
            self.num_pinned += 1

    def unpin(self, node: Node) -> None:
        if node.ref_count <= 0:
            raise RuntimeError(f"unpin of unpinned {node}")
        node.ref_count -= 1
        if node.ref_count == 0:
            self.num_pinned -= 1
            node.last_access = self.tick()
            self._maybe_push_leaf(node)

    # -- checkpoints ----------------------------------------------------------------------
    def attach_checkpoint(self, node: Node, slot: int, *, protected: bool = False) -> None:
        if node.checkpoint_slot is not None:
            raise RuntimeError(f"{node} already has a checkpoint")
        node.checkpoint_slot = slot
        self.num_checkpoints += 1
        node.ckpt_last_access = self.tick()
        node.ckpt_protected = protected
        self._maybe_push_ckpt(node)
        self._maybe_push_leaf(node)  # its leaf priority changed

    def detach_checkpoint(self, node: Node) -> int:
        slot = node.checkpoint_slot
        if slot is None:
            raise RuntimeError(f"{node} has no checkpoint")
        if node.ckpt_pins:
            raise RuntimeError(f"detach of pinned checkpoint on {node}")
        node.checkpoint_slot = None
        self.num_checkpoints -= 1
        self._maybe_push_leaf(node)
        return slot

    def demote_checkpoint(self, node: Node) -> None:
        """Move a checkpoint to the front of the eviction order (it is dominated by a deeper one)."""
        if node.ckpt_last_access > 0:
            node.ckpt_last_access -= _DEMOTED
            self._maybe_push_ckpt(node)

    @staticmethod
    def ckpt_key(node: Node) -> tuple[int, int]:
        """Checkpoint eviction order: demoted (dominated) first, then speculative ones (never
        hit yet: a finished request's tail or output), then proven-shared ones; LRU within."""
        if RadixTree.is_demoted(node):
            return (0, node.ckpt_last_access)
        return (2 if node.ckpt_protected else 1, node.ckpt_last_access)

    @staticmethod
    def is_demoted(node: Node) -> bool:
        return node.ckpt_last_access < 0

    def touch_checkpoint(self, node: Node) -> None:
        """A request restores from it: fresh in LRU order, and proven worth keeping."""
        node.ckpt_last_access = self.tick()
        node.ckpt_protected = True
        self._maybe_push_ckpt(node)

    def pin_checkpoint(self, node: Node) -> None:
        node.ckpt_pins += 1

    def unpin_checkpoint(self, node: Node) -> None:
        if node.ckpt_pins <= 0:
            raise RuntimeError(f"unpin of unpinned checkpoint on {node}")
        node.ckpt_pins -= 1
        if node.ckpt_pins == 0:
            self._maybe_push_ckpt(node)

    # -- eviction candidates -------------------------------------------------------------
    @staticmethod
    def is_evictable_leaf(node: Node) -> bool:
        return node.parent is not None and not node.children and node.ref_count == 0 and node.ckpt_pins == 0

    def _maybe_push_leaf(self, node: Node) -> None:
        if self.is_evictable_leaf(node):
            entry = (node.checkpoint_slot is not None, node.last_access, next(self._tie), node)
            heapq.heappush(self._leaf_heap, entry)

    def _maybe_push_ckpt(self, node: Node) -> None:
        if node.checkpoint_slot is not None and node.ckpt_pins == 0:
            heapq.heappush(self._ckpt_heap, (self.ckpt_key(node), next(self._tie), node))

    def peek_evictable_leaf(self) -> Node | None:
        """The best KV-eviction victim (checkpoint-less first, then LRU), not popped, or None."""
        while self._leaf_heap:
            has_ckpt, access, _, node = self._leaf_heap[0]
            valid = (
                self.is_evictable_leaf(node)
                and has_ckpt == (node.checkpoint_slot is not None)
                and access == node.last_access
            )
            if valid:
                return node
            heapq.heappop(self._leaf_heap)
        return None

    def peek_evictable_checkpoint(self) -> Node | None:
        """Least recently used unpinned checkpoint (not popped), or None."""
        while self._ckpt_heap:
            key, _, node = self._ckpt_heap[0]
            valid = (
                node.checkpoint_slot is not None
                and node.ckpt_pins == 0
                and key == self.ckpt_key(node)
                and node.parent is not None
            )
            if valid:
                return node
            heapq.heappop(self._ckpt_heap)
        return None

    def compact(self) -> None:
        """Drop stale heap entries when they dominate (keeps memory bounded)."""
        if len(self._leaf_heap) > 4 * (self.num_nodes + 64):
            self._leaf_heap = [e for e in self._leaf_heap if self.is_evictable_leaf(e[3])]
            heapq.heapify(self._leaf_heap)
        if len(self._ckpt_heap) > 4 * (self.num_nodes + 64):
            self._ckpt_heap = [e for e in self._ckpt_heap if e[2].checkpoint_slot is not None]
            heapq.heapify(self._ckpt_heap)

    # -- traversal -----------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
