"""DiskIndex: which disk items exist and which one goes next (pure: no I/O, no lock, torch-free).

The one eviction rule of the disk tier, shared by the persistent store (``cache/disk_store.py``,
which calls it under its lock) and the simulator's store (``tools/sim/disk.py``).

Rule: GreedyDual-Size-Frequency over *leaves*. An item's priority is H = L + freq * cost / size,
where a checkpoint's size is its own bytes plus the KV path only it keeps useful (walking up
its parents while each KV block has exactly one dependent, up to ``MAX_PATH_BLOCKS``). A KV
block's value lives in the checkpoints below it, so a KV leaf is worth L: it goes first. An
item that another stored *or queued* item names as ``parent`` is no leaf and never a victim.
The victim is the leaf of least H; L (``inflation``) rises to each victim's H; a read bumps
freq and re-prices the item at the current L.

Mechanics: a lazy heap of (H, sequence, generation, entry). Every re-push bumps the entry's
generation, so older heap entries are stale and skipped; the heap is rebuilt without them when
it outgrows the index. A checkpoint whose exclusive path shrank since it was pushed (a fork
appeared above it) is worth more per byte: it is re-priced when popped, not eagerly.

Contract: ``used`` is the bytes of the entries plus those reserved (``reserve``) for items
being written; ``make_room`` evicts until ``size`` more bytes fit within ``capacity``. A
dependency is registered (``depend``) when an item naming a parent is accepted (queued), before
room is made for it, so that its chain is not evicted from under it; ``add`` then takes that
registration over, and ``undepend`` cancels it if the item never lands.
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

# the kinds' values, shared by the store's ItemKind and the tier's DiskItemKind (IntEnums)
_KV = 1
_CHECKPOINT = 2
# a path longer than this many blocks is priced as if it forked there (bounds each walk)
MAX_PATH_BLOCKS = 1 << 16
# the heap is rebuilt without its stale entries past 2 x live + this many
_HEAP_SLACK = 1024


class DiskIndexError(ValueError):
    """A call that breaks the index's contract (an entry added twice, a dependency added
    without ``depend``, a negative size): a bug in the caller, never a cache miss."""


@dataclass(slots=True)
class DiskEntry:
    """One stored item and its GDSF state."""

    kind: enum.IntEnum  # 1: a KV block, 2: a checkpoint (ItemKind or DiskItemKind)
    key: int
    parent: int  # the KV block it depends on (0: none); a checkpoint's is its own key
    length: int  # payload bytes (the store names its file by them)
    size: int  # accounted bytes: what it costs against the capacity
    cost: float  # tokens of prefill a hit through it saves (0 for KV)
    freq: int = 1
    base: float = 0.0  # L when it was last pushed (added, read, or made a leaf)
    h: float = 0.0  # its priority as last pushed
    gen: int = 0  # heap entries with another generation are stale


@dataclass(frozen=True, slots=True)
class DiskIndexStats:
    items: int
    used: int  # entries' bytes + reserved
    reserved: int
    capacity: int
    inflation: float  # GDSF's L
    heap: int  # heap entries, stale ones included


class DiskIndex:
    """Entries, dependents, the lazy GDSF heap, L and the used bytes (module docstring)."""

    def __init__(self, capacity: int, *, max_path_blocks: int = MAX_PATH_BLOCKS) -> None:
        if capacity <= 0 or max_path_blocks <= 0:
            raise DiskIndexError(
                f"capacity and max_path_blocks must be > 0, got {capacity}, {max_path_blocks}"
            )
        self._capacity = capacity
        self._max_path = max_path_blocks
        self._entries: dict[tuple[int, int], DiskEntry] = {}
        # per KV key: stored or queued items naming it as parent (> 0: that block is no leaf)
        self._deps: dict[int, int] = {}
        self._pending: Counter[int] = Counter()  # the queued part of _deps
        self._heap: list[tuple[float, int, int, DiskEntry]] = []
        self._seq = 0
        self._inflation = 0.0
        self._used = 0
        self._reserved = 0
        # observer of the cache events (``cache/event_collector.py``): (kind, key, parent,
        # stored) for each entry added or removed, called under the owner's lock
        self.on_change: Callable[[int, int, int, bool], None] | None = None

    # ------------------------------------------------------------------ reading
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    @property
    def inflation(self) -> float:
        return self._inflation

    @property
    def heap(self) -> list[tuple[float, int, int, DiskEntry]]:
        """The lazy heap itself (read it, never change it): stale entries included."""
        return self._heap

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ident: tuple[int, int]) -> bool:
        return ident in self._entries

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._entries)

    def get(self, kind: int, key: int) -> DiskEntry | None:
        return self._entries.get((kind, key))

    def entries(self) -> list[DiskEntry]:
        return list(self._entries.values())

    def dependents(self, key: int) -> int:
        """Stored and queued items that name KV block ``key`` as parent."""
        return self._deps.get(key, 0)

    def stats(self) -> DiskIndexStats:
        return DiskIndexStats(
            len(self._entries), self._used, self._reserved, self._capacity, self._inflation, len(self._heap)
        )

    # ------------------------------------------------------------------ changing
    def load(self, entries: Iterable[DiskEntry], inflation: float) -> None:
        """Fill an empty index with what a store found at open (frequencies as saved), at L =
        ``inflation``. Dependencies are counted first so each entry is pushed as what it is.
        May leave ``used`` above the capacity: ``make_room(0)`` then evicts the excess."""
        if self._entries or self._deps:
            raise DiskIndexError("load fills an empty index only")
        self._inflation = inflation
        for e in entries:
            if (e.kind, e.key) in self._entries:
                raise DiskIndexError(f"entry {e.kind!r} {e.key:x} loaded twice")
            self._entries[(e.kind, e.key)] = e
            self._used += e.size
            if e.parent:
                self._deps[e.parent] = self._deps.get(e.parent, 0) + 1
        for e in self._entries.values():
            self._push(e)

    def depend(self, parent: int) -> None:
        """An item naming ``parent`` was accepted: that block is no leaf until it goes."""
        if parent:
            self._deps[parent] = self._deps.get(parent, 0) + 1
            self._pending[parent] += 1

    def undepend(self, parent: int) -> None:
        """An accepted item naming ``parent`` will not land (dropped, failed to write)."""
        if parent:
            self._take_pending(parent)
            self._drop_dependent(parent)

    def reserve(self, size: int) -> None:
        """Count ``size`` bytes as used while an item is written (after ``make_room``)."""
        if size < 0:
            raise DiskIndexError(f"size must be >= 0, got {size}")
        self._used += size
        self._reserved += size

    def release(self, size: int) -> None:
        """Give back bytes ``reserve`` took (the item failed, or ``add`` counts it now)."""
        if not 0 <= size <= self._reserved:
            raise DiskIndexError(f"cannot release {size} bytes, {self._reserved} reserved")
        self._used -= size
        self._reserved -= size

    def add(self, entry: DiskEntry) -> None:
        """Store ``entry`` (its bytes count as used; room was made for them). A parent must
        have been registered with ``depend``: the dependency carries over."""
        ident = (entry.kind, entry.key)
        if ident in self._entries:
            raise DiskIndexError(f"entry {entry.kind!r} {entry.key:x} is already stored")
        if entry.parent:
            self._take_pending(entry.parent)
        self._entries[ident] = entry
        self._used += entry.size
        self._push(entry)
        if self.on_change is not None:
            self.on_change(entry.kind, entry.key, entry.parent, True)

    def remove(self, entry: DiskEntry) -> None:
        """Forget a stored entry (evicted or found damaged); its parent may become a leaf."""
        del self._entries[(entry.kind, entry.key)]
        if self.on_change is not None:
            self.on_change(entry.kind, entry.key, entry.parent, False)
        self._used -= entry.size
        entry.gen += 1
        self._drop_dependent(entry.parent)

    def touch(self, entry: DiskEntry) -> None:
        """A read: one more use, re-priced at the current L."""
        entry.freq += 1
        self._push(entry)

    def make_room(self, size: int) -> tuple[list[DiskEntry], bool]:
        """Evict (remove) victims in order until ``size`` more bytes fit; the victims and
        whether they fit (not when ``size`` exceeds the capacity, or every item left is a
        non-leaf whose dependent is still queued)."""
        if size > self._capacity:
            return [], False
        victims: list[DiskEntry] = []
        while self._used + size > self._capacity:
            v = self.pop_victim()
            if v is None:
                return victims, False
            self.remove(v)
            victims.append(v)
        return victims, True

    def pop_victim(self) -> DiskEntry | None:
        """The leaf of least H (still stored: ``remove`` it), L raised to its H; None if no
        leaf is left."""
        while self._heap:
            h, _, gen, e = heapq.heappop(self._heap)
            if e.gen != gen or not self._is_leaf(e):
                continue
            if e.kind == _CHECKPOINT and e.cost > 0:
                now = e.base + e.freq * e.cost / self._exclusive_size(e)
                if now > h:  # a fork appeared above it since: its own path, so its bytes, shrank
                    e.h = now
                    self._seq += 1
                    heapq.heappush(self._heap, (now, self._seq, gen, e))
                    continue
            self._inflation = max(self._inflation, h)
            return e
        return None

    def check_integrity(self) -> None:
        """Bytes, dependents and the heap agree with the entries; raises AssertionError."""
        stored = sum(e.size for e in self._entries.values())
        assert self._used == stored + self._reserved, f"used {self._used} != {stored} + {self._reserved}"
        assert self._reserved >= 0, "reserved bytes"
        deps = Counter(e.parent for e in self._entries.values() if e.parent) + self._pending
        assert deps == Counter(self._deps), "dependents"
        assert all(n > 0 for n in self._deps.values()), "a zero dependents count is kept"
        live = {id(e) for _, _, gen, e in self._heap if e.gen == gen}
        for e in self._entries.values():
            leaf = self._is_leaf(e)
            assert not leaf or id(e) in live, f"leaf {e.kind!r} {e.key:x} is not in the heap"

    # ------------------------------------------------------------------ internals
    def _take_pending(self, parent: int) -> None:
        left = self._pending[parent] - 1
        if left < 0:
            raise DiskIndexError(f"no queued dependency on {parent:x} (call depend first)")
        if left:
            self._pending[parent] = left
        else:
            del self._pending[parent]

    def _exclusive_size(self, e: DiskEntry) -> int:
        """A checkpoint's bytes plus the KV path only it keeps useful."""
        total, k = e.size, e.parent
        for _ in range(self._max_path):
            kv = self._entries.get((_KV, k)) if k else None
            if kv is None or self._deps.get(k, 0) != 1:
                break
            total += kv.size
            k = kv.parent
        return total

    def _priority(self, e: DiskEntry) -> float:
        """H = L + freq * cost / size; a KV block's value lives in its checkpoints."""
        if e.kind == _KV or e.cost <= 0:
            return e.base
        return e.base + e.freq * e.cost / self._exclusive_size(e)

    def _is_leaf(self, e: DiskEntry) -> bool:
        return e.kind == _CHECKPOINT or self._deps.get(e.key, 0) == 0

    def _push(self, e: DiskEntry) -> None:
        """(Re)insert ``e`` in the heap if it is a leaf; its older heap entries go stale."""
        e.gen += 1
        if not self._is_leaf(e):
            return
        e.base = self._inflation
        e.h = self._priority(e)
        self._seq += 1
        heapq.heappush(self._heap, (e.h, self._seq, e.gen, e))
        if len(self._heap) > 2 * len(self._entries) + _HEAP_SLACK:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale heap entries (each re-push leaves one behind)."""
        live = [t for t in self._heap if t[3].gen == t[2]]
        heapq.heapify(live)
        self._heap = live

    def _drop_dependent(self, parent: int) -> None:
        """One dependent of ``parent`` is gone; with none left the KV block there is a leaf."""
        if not parent:
            return
        left = self._deps.get(parent, 0) - 1
        if left > 0:
            self._deps[parent] = left
            return
        self._deps.pop(parent, None)
        kv = self._entries.get((_KV, parent))
        if kv is not None:
            self._push(kv)
