"""Radix index of full KV blocks, one node per block, children keyed by chained hash.

A node owns one KV block (for all full-attention layers) and optionally one checkpoint:
the GDN state at the node's end boundary ``depth * block_size``. With a host tier
(``cache/host_tier.py``) each lives in one tier at a time: the KV block on the device
(``block_id >= 0``) or on the host (``block_id == -1``, ``host_block >= 0``), the checkpoint
in a device slot (``checkpoint_slot``, only on a device node) and/or a host slot
(``host_slot``). Device nodes form the top of the tree (a device node's parent is a device
node or the root); host nodes hang below them. A node whose item is being copied between
tiers is ``moving`` (KV) / ``ckpt_moving`` (checkpoint) until the copy has landed: a match
stops before a moving node and never ends on a moving checkpoint, so nobody reads an item
whose copy may still fail.

KV-eviction candidates are kept in lazily-invalidated heaps ordered by ``(has_checkpoint,
last_access)``, so that picking a victim is O(log n) even with hundreds of thousands of
nodes (the simulator replays big workloads): a leaf with no checkpoint (and nothing below)
can never end a hybrid hit, so it goes first. Device candidates are unpinned device nodes
with no device child (their host children, if any, are demoted along); host candidates
are unpinned host nodes with no child at all. A heap entry is valid only if its recorded
priority still equals the node's current one; anything else is skipped when popped.
Checkpoint eviction order is the eviction strategy's (``cache/eviction.py``); it keeps its
per-node bookkeeping in ``Node.policy_state``, of a type it defines.

``version`` moves on every change that can change a match (insert, removal, attach and
detach of a checkpoint), so a match result can be cached until it does.

``deeper_checkpoint(node)`` — the nearest checkpoint (either tier) below ``node`` on a path with
no fork — is memoised on the node. The answer of a node ``U`` changes only when a checkpoint
comes or goes on its unforked chain, or a fork appears or disappears on it; each such event
clears the memo of the nodes whose walk reaches it, walking up from it while the path above
has no fork and stopping at the first checkpoint (``_forget_deeper_up``). So a host whose
victim scan asks every checkpoint's band pays a chain walk per change, not per question; and
each host checkpoint whose memo is cleared is recorded (``take_deeper_reset``), so the host
knows which of its checkpoints have a deeper one without asking them all.
Torch-free.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

UNKNOWN = object()  # ``Node.deeper`` not computed since the last change below the node


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
        "policy_state",
        "host_block",
        "host_slot",
        "moving",
        "ckpt_moving",
        "device_children",
        "deeper",
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
        # the eviction strategy's bookkeeping of this node's checkpoint (its type, its
        # business); set when a checkpoint is attached, kept while it lives on the host
        self.policy_state: Any = None
        self.host_block = -1  # host-tier KV block (-1: none)
        self.host_slot: int | None = None  # host-tier checkpoint slot
        self.moving = False  # its KV block is being copied between tiers (not matchable)
        self.ckpt_moving = False  # its host checkpoint is being written (not a hit yet)
        self.device_children = 0  # children whose KV is on the device
        # memo of ``RadixTree.deeper_checkpoint`` (``UNKNOWN`` until asked, or after a change)
        self.deeper: Node | None | object = UNKNOWN

    def __repr__(self) -> str:
        return (
            f"Node(depth={self.depth}, block={self.block_id}, ckpt={self.checkpoint_slot}, ref={self.ref_count}"
            + (
                f", host_block={self.host_block}, host_slot={self.host_slot}"
                if self.host_block >= 0 or self.host_slot is not None
                else ""
            )
            + ")"
        )

    @property
    def on_device(self) -> bool:
        return self.block_id >= 0

    @property
    def has_checkpoint(self) -> bool:
        """A usable checkpoint in either tier (a host one still being written is not)."""
        return self.checkpoint_slot is not None or (self.host_slot is not None and not self.ckpt_moving)


class RadixTree:
    def __init__(self) -> None:
        self.root = Node(key=0, parent=None, block_id=-1, depth=0)
        self.num_nodes = 0
        self.num_pinned = 0  # nodes with ref_count > 0 (O(1) usage reporting)
        self.num_checkpoints = 0  # nodes holding a checkpoint
        self.version = 0  # moves whenever a match could change
        # host checkpoints whose ``deeper_checkpoint`` memo was cleared since the host last
        # looked (``take_deeper_reset``): the host tier keeps its dominated candidates with it
        self.deeper_reset: set[Node] = set()
        self._clock = itertools.count(1)
        self._leaf_heap: list[tuple[bool, int, int, Node]] = []
        self._host_heap: list[tuple[bool, int, int, Node]] = []
        self._tie = itertools.count()
        self.by_block: dict[int, Node] = {}  # device block id -> the node holding it
        # observers (the loss attribution, ``cache/loss.py``): a node leaves the tree; a
        # checkpoint leaves a tier (the key of the block it ends)
        self.on_remove: Callable[[Node], None] | None = None
        self.on_checkpoint_gone: Callable[[int], None] | None = None
        # observer of the cache events (``cache/event_collector.py``): a node whose tier
        # membership may have changed (it reads the node's state later, once per step)
        self.on_change: Callable[[Node], None] | None = None

    def tick(self) -> int:
        return next(self._clock)

    # -- lookup / insert / remove -------------------------------------------------------
    def match(self, hashes: list[int]) -> list[Node]:
        """Longest path from the root whose keys equal ``hashes[:k]`` (stopping before a
        node whose KV is moving between tiers)."""
        path: list[Node] = []
        node = self.root
        for h in hashes:
            child = node.children.get(h)
            if child is None or child.moving:
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
        if len(parent.children) == 2:  # a fork now: walks through ``parent`` stop there
            self._forget_deeper_up(parent)
        parent.device_children += 1
        if block_id >= 0:
            self.by_block[block_id] = node
        self.num_nodes += 1
        self.version += 1
        self._maybe_push_leaf(node)
        self._changed(node)
        return node

    def remove_leaf(self, node: Node) -> None:
        if node.children or node.ref_count or node.parent is None:
            raise RuntimeError(f"cannot remove {node}")
        parent = node.parent
        if self.on_remove is not None:
            self.on_remove(node)
        del parent.children[node.key]
        if len(parent.children) == 1 or (not parent.children and self._holds_checkpoint(node)):
            self._forget_deeper_up(parent)  # a fork gone, or a checkpoint with its node
        if node.block_id >= 0:
            parent.device_children -= 1
            del self.by_block[node.block_id]
        node.parent = None
        self._changed(node)
        self.num_nodes -= 1
        self.version += 1
        if parent is not self.root:
            self._maybe_push_leaf(parent)

    # -- tiers ---------------------------------------------------------------------------
    def demote(self, node: Node, host_block: int) -> int:
        """``node``'s KV leaves the device for ``host_block`` (being written: ``moving``);
        returns the device block it held. Only a node with no device child can go."""
        if node.block_id < 0 or node.device_children or node.ref_count or node.parent is None:
            raise RuntimeError(f"cannot demote {node}")
        block, node.block_id = node.block_id, -1
        del self.by_block[block]
        node.host_block = host_block
        node.parent.device_children -= 1
        self.set_moving(node, True)  # (tells ``on_change``)
        self._maybe_push_leaf(node.parent)
        return block

    def promote(self, node: Node, block_id: int) -> None:
        """``node``'s KV gets device block ``block_id`` (its parent must be on the device)."""
        parent = node.parent
        if node.block_id >= 0 or parent is None or (parent is not self.root and parent.block_id < 0):
            raise RuntimeError(f"cannot promote {node}")
        node.block_id = block_id
        self.by_block[block_id] = node
        parent.device_children += 1
        self.version += 1
        self._changed(node)

    def move(self, node: Node, block_id: int) -> int:
        """``node``'s KV moves to device block ``block_id`` (a copy the caller plans, and the
        block tables of the requests pinning it are the caller's to update); returns the block
        it held. Only a device node that is not moving between tiers."""
        if node.block_id < 0 or node.moving:
            raise RuntimeError(f"cannot move {node}")
        old, node.block_id = node.block_id, block_id
        del self.by_block[old]
        self.by_block[block_id] = node
        self.version += 1
        return old

    def set_moving(self, node: Node, moving: bool) -> None:
        node.moving = moving
        self.version += 1
        self._maybe_push_leaf(node)
        self._changed(node)

    def set_ckpt_moving(self, node: Node, moving: bool) -> None:
        node.ckpt_moving = moving
        self.version += 1
        self._maybe_push_leaf(node)
        self._changed(node)

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
        self.checkpoint_changed(node)
        self.num_checkpoints += 1
        self.version += 1
        self._maybe_push_leaf(node)  # its leaf priority changed
        self._changed(node)

    def detach_checkpoint(self, node: Node) -> int:
        slot = node.checkpoint_slot
        if slot is None:
            raise RuntimeError(f"{node} has no checkpoint")
        if node.ckpt_pins:
            raise RuntimeError(f"detach of pinned checkpoint on {node}")
        node.checkpoint_slot = None
        self.checkpoint_changed(node)
        if self.on_checkpoint_gone is not None:
            self.on_checkpoint_gone(node.key)
        self.num_checkpoints -= 1
        self.version += 1
        self._maybe_push_leaf(node)
        self._changed(node)
        return slot

    # -- the checkpoint below -----------------------------------------------------------
    @staticmethod
    def _holds_checkpoint(node: Node) -> bool:
        return node.checkpoint_slot is not None or node.host_slot is not None

    def deeper_checkpoint(self, node: Node) -> Node | None:
        """The nearest checkpoint (either tier, a host one being written included) below
        ``node`` on a path with no fork, or None; memoised (see the module docstring)."""
        known = node.deeper
        if known is not UNKNOWN:
            return known  # type: ignore[return-value]
        found: Node | None = None
        below = node
        while len(below.children) == 1:
            below = next(iter(below.children.values()))
            if self._holds_checkpoint(below):
                found = below
                break
        node.deeper = found
        return found

    def checkpoint_changed(self, node: Node) -> None:
        """A checkpoint came to or left ``node`` (either tier): the walks that reach it change."""
        parent = node.parent
        if parent is not None and len(parent.children) == 1:
            self._forget_deeper_up(parent)

    def _forget_deeper_up(self, node: Node) -> None:
        """Clear the memo of ``node`` and of every node whose walk down reaches it: up while
        the node above has this one as its only child, to the first checkpoint (a walk from
        above stops there)."""
        while True:
            node.deeper = UNKNOWN
            if self._holds_checkpoint(node):
                # the walk ends at the first checkpoint: every reset of a checkpoint's memo is here
                if node.host_slot is not None:
                    self.deeper_reset.add(node)
                return
            parent = node.parent
            if parent is None or len(parent.children) != 1:
                return
            node = parent

    def take_deeper_reset(self) -> set[Node]:
        """The host checkpoints whose deeper checkpoint may have changed since the last call
        (some may have left the host since)."""
        reset, self.deeper_reset = self.deeper_reset, set()
        return reset

    def check_deeper(self, nodes: list[Node]) -> None:
        """Every memo of ``deeper_checkpoint`` still equals a fresh walk."""
        for node in nodes:
            if node.deeper is not UNKNOWN:
                known, node.deeper = node.deeper, UNKNOWN
                assert self.deeper_checkpoint(node) is known, f"stale deeper-checkpoint memo on {node}"

    def pin_checkpoint(self, node: Node) -> None:
        node.ckpt_pins += 1

    def unpin_checkpoint(self, node: Node) -> None:
        if node.ckpt_pins <= 0:
            raise RuntimeError(f"unpin of unpinned checkpoint on {node}")
        node.ckpt_pins -= 1

    # -- eviction candidates -------------------------------------------------------------
    @staticmethod
    def is_evictable_leaf(node: Node) -> bool:
        """An unpinned device node with no device child (a device-eviction candidate)."""
        return (
            node.parent is not None
            and node.block_id >= 0
            and node.device_children == 0
            and node.ref_count == 0
            and node.ckpt_pins == 0
            and not node.moving
        )

    @staticmethod
    def is_host_leaf(node: Node) -> bool:
        """An unpinned host node with no child (a host-eviction candidate)."""
        return (
            node.parent is not None
            and node.block_id < 0
            and not node.children
            and node.ref_count == 0
            and node.ckpt_pins == 0
            and not node.moving
            and not node.ckpt_moving
        )

    @staticmethod
    def _keeps(node: Node) -> bool:
        """Evicting it loses more than a block: a checkpoint, or host nodes below it."""
        return node.checkpoint_slot is not None or node.host_slot is not None or bool(node.children)

    def refresh(self, node: Node) -> None:
        """Re-queue ``node`` as an eviction candidate after a change to what it holds."""
        self._maybe_push_leaf(node)
        self._changed(node)

    def _changed(self, node: Node) -> None:
        if self.on_change is not None:
            self.on_change(node)

    def _maybe_push_leaf(self, node: Node) -> None:
        if self.is_evictable_leaf(node):
            heapq.heappush(self._leaf_heap, (self._keeps(node), node.last_access, next(self._tie), node))
        elif self.is_host_leaf(node):
            heapq.heappush(self._host_heap, (self._keeps(node), node.last_access, next(self._tie), node))

    def _peek(self, heap: list[tuple[bool, int, int, Node]], valid: Any) -> Node | None:
        while heap:
            keeps, access, _, node = heap[0]
            if valid(node) and keeps == self._keeps(node) and access == node.last_access:
                return node
            heapq.heappop(heap)
        return None

    def peek_evictable_leaf(self) -> Node | None:
        """The best device KV-eviction victim (nothing kept first, then LRU), or None."""
        return self._peek(self._leaf_heap, self.is_evictable_leaf)

    def peek_host_leaf(self) -> Node | None:
        """The best host KV-eviction victim (checkpoint-less first, then LRU), or None."""
        return self._peek(self._host_heap, self.is_host_leaf)

    def compact(self) -> None:
        """Drop stale heap entries when they dominate (keeps memory bounded)."""
        if len(self._leaf_heap) > 4 * (self.num_nodes + 64):
            self._leaf_heap = [e for e in self._leaf_heap if self.is_evictable_leaf(e[3])]
            heapq.heapify(self._leaf_heap)
        if len(self._host_heap) > 4 * (self.num_nodes + 64):
            self._host_heap = [e for e in self._host_heap if self.is_host_leaf(e[3])]
            heapq.heapify(self._host_heap)

    # -- traversal -----------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
