"""Which cache items entered or left a tier since the last step: the events of one step.

What a tier holds (``contents``, the one definition the events and their tests share):

* ``GPU`` KV: a tree node whose block is on the device and not being copied (``block_id >=
  0``, not ``moving``); ``CPU`` KV: a host node not being copied (``block_id < 0``,
  ``host_block >= 0``, not ``moving``): exactly the blocks a match can use, each in one tier;
* ``GPU`` checkpoint: a node's device checkpoint slot; ``CPU`` checkpoint: its host slot once
  written (not ``ckpt_moving``);
* ``DISK``: the disk store's indexed items (KV blocks and checkpoints), as its index says;
* ``REMOTE``: the items of the shared store (``cache/remote_store.py``) this engine wrote there
  or read and verified, as the remote store's local knowledge says (``RemoteStore.items``);
  the store may since have evicted one (reads verify), and other replicas publish theirs.

How: the radix tree tells the collector of every node whose tier membership may have changed
(``RadixTree.on_change``; insert, removal, demotion, promotion, the copy flags, checkpoint
attach and detach); the disk index tells it of every item added or removed
(``DiskIndex.on_change``, from the store's writer thread), and so does the remote store
(``RemoteStore.on_change``, from its writer and reader threads): those go through a deque,
which appends and pops atomically. ``take_events`` (the core, once per step) compares the current
membership of the nodes it was told of with what it last published and returns the
difference as events, so a node that came and went within one step publishes nothing and the
order of a step's changes does not matter. Its cost is the number of nodes touched in the
step, never the size of the cache.

Invariant (the event test checks it after every step): applying every event taken so far to
an empty index gives ``contents`` of the cache at the time of the last ``take_events``.
Torch-free and zmq-free.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from deltaserve.cache.kv_events import (
    MEDIA,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
    Event,
    hash_bytes,
)
from deltaserve.cache.radix_tree import Node, RadixTree

_KV = 1  # the disk index's kinds (``cache/disk_index.py``)
_CHECKPOINT = 2
_STORES = (MEDIUM_DISK, MEDIUM_REMOTE)  # the tiers whose stores report their items themselves


@dataclass
class Contents:
    """What each tier holds: KV block hashes and checkpoint block hashes per medium."""

    blocks: dict[str, set[int]] = field(default_factory=lambda: {m: set() for m in MEDIA})
    checkpoints: dict[str, set[int]] = field(default_factory=lambda: {m: set() for m in MEDIA})


def kv_medium(node: Node) -> str | None:
    """The tier a matchable node's KV block is in (None: none, or being copied)."""
    if node.parent is None or node.moving:
        return None
    if node.block_id >= 0:
        return MEDIUM_GPU
    return MEDIUM_CPU if node.host_block >= 0 else None


def checkpoint_media(node: Node) -> tuple[bool, bool]:
    """Whether a live node has a device checkpoint, and a written host one."""
    if node.parent is None:
        return False, False
    return node.checkpoint_slot is not None, node.host_slot is not None and not node.ckpt_moving


def contents(
    tree: RadixTree,
    disk_items: Iterable[tuple[int, int]] = (),
    remote_items: Iterable[tuple[int, int]] = (),
) -> Contents:
    """What the cache holds now, per tier (O(cache): for tests and checks, never per step)."""
    out = Contents()
    for node in tree.nodes():
        medium = kv_medium(node)
        if medium is not None:
            out.blocks[medium].add(node.key)
        gpu, cpu = checkpoint_media(node)
        if gpu:
            out.checkpoints[MEDIUM_GPU].add(node.key)
        if cpu:
            out.checkpoints[MEDIUM_CPU].add(node.key)
    for medium, items in ((MEDIUM_DISK, disk_items), (MEDIUM_REMOTE, remote_items)):
        for kind, key in items:
            (out.blocks if kind == _KV else out.checkpoints)[medium].add(key)
    return out


class KVEventCollector:
    """Turns the cache's changes into vLLM-format events, one list per step."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._dirty: set[Node] = set()
        # (medium, kind, key, parent, present) of the stores' items, from their threads
        self._store_ops: collections.deque[tuple[str, int, int, int, bool]] = collections.deque()
        # what was last published: KV block -> its medium (one tier at a time), the parent of
        # each published block, checkpoints per medium, each store's items (KV: key -> parent)
        self._kv: dict[int, str] = {}
        self._parent: dict[int, int] = {}
        self._ckpt: dict[str, set[int]] = {MEDIUM_GPU: set(), MEDIUM_CPU: set()}
        self._store_kv: dict[str, dict[int, int]] = {m: {} for m in _STORES}
        self._store_ckpt: dict[str, set[int]] = {m: set() for m in _STORES}
        # a block's tokens while it is in the device or host tier (the disk keeps none)
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._pending: list[Event] = [AllBlocksCleared()]  # a (re)started engine holds nothing yet

    # ------------------------------------------------------------------ hooks
    def attach(self, tree: RadixTree) -> None:
        tree.on_change = self._dirty.add

    def note_tokens(self, key: int, tokens: Sequence[int]) -> None:
        """The tokens of block ``key`` (published from a request that has them)."""
        self._tokens[key] = tuple(tokens)

    def disk_changed(self, kind: int, key: int, parent: int, present: bool) -> None:
        """A disk item was indexed (``present``) or dropped; any thread."""
        self._store_ops.append((MEDIUM_DISK, int(kind), key, parent, present))

    def remote_changed(self, kind: int, key: int, parent: int, present: bool) -> None:
        """A remote item became known to this engine (``present``) or was forgotten; any thread."""
        self._store_ops.append((MEDIUM_REMOTE, int(kind), key, parent, present))

    def disk_loaded(self, items: Iterable[tuple[int, int, int]]) -> None:
        """The disk store's items (kind, key, parent) when it was opened."""
        for kind, key, parent in items:
            self.disk_changed(kind, key, parent, True)

    # ------------------------------------------------------------------ per step
    def take_events(self) -> list[Event]:
        """The events since the last call (possibly none)."""
        events, self._pending = self._pending, []
        if self._dirty:
            events += self._tree_events()
        if self._store_ops:
            events += self._store_events()
        return events

    def _tree_events(self) -> list[Event]:
        dirty = list(self._dirty)
        self._dirty.clear()  # (in place: the tree holds this set's ``add``)
        # one live node per key at most (a removed one has no parent): the live one decides
        state: dict[int, tuple[str | None, bool, bool, int]] = {}
        for node in dirty:
            if node.parent is None and node.key in state:
                continue
            gpu, cpu = checkpoint_media(node)
            parent = node.parent.key if node.parent is not None and node.parent.parent is not None else 0
            state[node.key] = (kv_medium(node), gpu, cpu, parent)
        ck_removed: list[Event] = []
        ck_stored: list[Event] = []
        removed: dict[str, list[int]] = {}
        stored: list[tuple[int, int, str]] = []  # (key, parent, medium)
        for key, (medium, gpu, cpu, parent) in state.items():
            for m, has in ((MEDIUM_GPU, gpu), (MEDIUM_CPU, cpu)):
                held = self._ckpt[m]
                if has and key not in held:
                    held.add(key)
                    ck_stored.append(CheckpointStored(hash_bytes(key), m))
                elif not has and key in held:
                    held.discard(key)
                    ck_removed.append(CheckpointRemoved(hash_bytes(key), m))
            old = self._kv.get(key)
            if old == medium:
                continue
            if old is not None:
                removed.setdefault(old, []).append(key)
            if medium is None:
                del self._kv[key]
                self._parent.pop(key, None)
                self._tokens.pop(key, None)
            else:
                self._kv[key] = medium
                self._parent[key] = parent
                stored.append((key, parent, medium))
        events = ck_removed
        events += [BlockRemoved([hash_bytes(k) for k in keys], m) for m, keys in removed.items()]
        events += self._stored_chains(stored)
        events += ck_stored
        return events

    def _stored_chains(self, stored: list[tuple[int, int, str]]) -> list[Event]:
        """One ``BlockStored`` per run of blocks that chain (each the parent of the next) in
        one medium, parents first, as vLLM sends a request's new blocks."""
        out: list[BlockStored] = []
        tail: dict[tuple[str, int], BlockStored] = {}  # (medium, last key) -> its open event
        depth = self._depth_of(stored)
        for key, parent, medium in sorted(stored, key=lambda s: depth[s[0]]):
            tokens = self._tokens.get(key, ())
            ev = tail.pop((medium, parent), None)
            if ev is not None and bool(ev.token_ids) == bool(tokens):
                ev.block_hashes.append(hash_bytes(key))
                ev.token_ids.extend(tokens)
            else:
                ev = BlockStored(
                    block_hashes=[hash_bytes(key)],
                    parent_block_hash=hash_bytes(parent) if parent else None,
                    token_ids=list(tokens),
                    block_size=self.block_size,
                    lora_id=None,
                    medium=medium,
                )
                out.append(ev)
            tail[(medium, key)] = ev
        return list(out)

    def _depth_of(self, stored: list[tuple[int, int, str]]) -> dict[int, int]:
        """Each stored key's number of published ancestors among this batch (a sort key that
        puts parents first)."""
        parents = {key: parent for key, parent, _ in stored}
        depth: dict[int, int] = {}
        for key in parents:
            chain: list[int] = []
            k = key
            while k in parents and k not in depth:
                chain.append(k)
                k = parents[k]
            base = depth.get(k, -1)
            for k in reversed(chain):
                base += 1
                depth[k] = base
        return depth

    def _store_events(self) -> list[Event]:
        latest: dict[tuple[str, int, int], tuple[int, bool]] = {}
        while self._store_ops:
            medium, kind, key, parent, present = self._store_ops.popleft()
            latest[(medium, kind, key)] = (parent, present)
        ck_removed: list[Event] = []
        ck_stored: list[Event] = []
        gone: dict[str, list[int]] = {}
        stored: list[tuple[int, int, str]] = []
        for (medium, kind, key), (parent, present) in latest.items():
            if kind == _CHECKPOINT:
                held = self._store_ckpt[medium]
                if present and key not in held:
                    held.add(key)
                    ck_stored.append(CheckpointStored(hash_bytes(key), medium))
                elif not present and key in held:
                    held.discard(key)
                    ck_removed.append(CheckpointRemoved(hash_bytes(key), medium))
                continue
            kv = self._store_kv[medium]
            if present and key not in kv:
                kv[key] = parent
                stored.append((key, parent, medium))
            elif not present and key in kv:
                del kv[key]
                gone.setdefault(medium, []).append(key)
        events = ck_removed
        events += [BlockRemoved([hash_bytes(k) for k in keys], m) for m, keys in gone.items()]
        events += self._stored_chains(stored)
        events += ck_stored
        return events

    # ------------------------------------------------------------------ resync
    def resync_events(self) -> list[Event]:
        """``AllBlocksCleared`` and everything published as held (after ``take_events``): what
        a subscriber needs to start over after a batch was lost for good."""
        events: list[Event] = [AllBlocksCleared()]
        events += self._stored_chains([(k, self._parent.get(k, 0), m) for k, m in self._kv.items()])
        events += [CheckpointStored(hash_bytes(k), m) for m, keys in self._ckpt.items() for k in keys]
        for m in _STORES:
            events += self._stored_chains([(k, p, m) for k, p in self._store_kv[m].items()])
            events += [CheckpointStored(hash_bytes(k), m) for k in self._store_ckpt[m]]
        return events
