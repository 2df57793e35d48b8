"""Radix index of full KV blocks, one node per block, children keyed by chained hash.

A node owns one KV block id (for all full-attention layers) and optionally one
checkpoint slot: the GDN state at the node's end boundary ``depth * block_size``.

KV-eviction candidates (unpinned leaves) are kept in a lazily-invalidated heap ordered by
``(has_checkpoint, last_access)``, so that picking a victim is O(log n) even with hundreds
of thousands of nodes (the simulator replays big workloads): a leaf with no checkpoint can
never end a hybrid hit, so it goes first. A heap entry is valid only if its recorded
priority still equals the node's current one; anything else is skipped when popped.
Checkpoint eviction order is the checkpoint store's (``cache/value.py``); the per-node
checkpoint fields below are its bookkeeping.

``version`` moves on every change that can change a match (insert, removal, attach and
detach of a checkpoint), so a match result can be cached until it does. Torch-free.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any


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
        "ckpt_kind",
        "ckpt_hits",
        "ckpt_since",
        "ckpt_base",
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
        # v1: proven shared (restored from by a request, or taken at a divergence point)
        self.ckpt_protected = False
        # value model: the capture kind, hits served, and when its current reuse class began
        self.ckpt_kind: Any = None
        self.ckpt_hits = 0
        self.ckpt_since = 0
        self.ckpt_base: Node | None = None  # the nearest checkpoint above it (when it was valued)

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, block={self.block_id}, ckpt={self.checkpoint_slot}, ref={self.ref_count})"


class RadixTree:
    def __init__(self) -> None:
        self.root = Node(key=0, parent=None, block_id=-1, depth=0)
        self.num_nodes = 0
        self.num_pinned = 0  # nodes with ref_count > 0 (O(1) usage reporting)
        self.num_checkpoints = 0  # nodes holding a checkpoint
        self.version = 0  # moves whenever a match could change
        self._clock = itertools.count(1)
        self._leaf_heap: list[tuple[bool, int, int, Node]] = []
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
        self.version += 1
        self._maybe_push_leaf(node)
        return node

    def remove_leaf(self, node: Node) -> None:
        if node.children or node.ref_count or node.parent is None:
            raise RuntimeError(f"cannot remove {node}")
        parent = node.parent
        del parent.children[node.key]
        node.parent = None
        self.num_nodes -= 1
        self.version += 1
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
    def attach_checkpoint(self, node: Node, slot: int) -> None:
        if node.checkpoint_slot is not None:
            raise RuntimeError(f"{node} already has a checkpoint")
        node.checkpoint_slot = slot
        self.num_checkpoints += 1
        self.version += 1
        self._maybe_push_leaf(node)  # its leaf priority changed

    def detach_checkpoint(self, node: Node) -> int:
        slot = node.checkpoint_slot
        if slot is None:
            raise RuntimeError(f"{node} has no checkpoint")
        if node.ckpt_pins:
            raise RuntimeError(f"detach of pinned checkpoint on {node}")
        node.checkpoint_slot = None
        self.num_checkpoints -= 1
        self.version += 1
        self._maybe_push_leaf(node)
        return slot

    def pin_checkpoint(self, node: Node) -> None:
        node.ckpt_pins += 1

    def unpin_checkpoint(self, node: Node) -> None:
        if node.ckpt_pins <= 0:
            raise RuntimeError(f"unpin of unpinned checkpoint on {node}")
        node.ckpt_pins -= 1

    # -- eviction candidates -------------------------------------------------------------
    @staticmethod
    def is_evictable_leaf(node: Node) -> bool:
        return node.parent is not None and not node.children and node.ref_count == 0 and node.ckpt_pins == 0

    def _maybe_push_leaf(self, node: Node) -> None:
        if self.is_evictable_leaf(node):
            entry = (node.checkpoint_slot is not None, node.last_access, next(self._tie), node)
            heapq.heappush(self._leaf_heap, entry)

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

    def compact(self) -> None:
        """Drop stale heap entries when they dominate (keeps memory bounded)."""
        if len(self._leaf_heap) > 4 * (self.num_nodes + 64):
            self._leaf_heap = [e for e in self._leaf_heap if self.is_evictable_leaf(e[3])]
            heapq.heapify(self._leaf_heap)

    # -- traversal -----------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
