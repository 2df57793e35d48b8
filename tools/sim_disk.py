"""The disk tier in the simulator: an in-memory store and a reader on the simulated clock.

* ``SimStore``: the ``Store`` protocol of ``cache/disk_tier.py`` with no I/O and no payloads
  kept (the simulator's copies carry no bytes). Capacity is accounted in the simulated
  model's item sizes (one KV block, one checkpoint), and ``read`` returns a shared buffer of
  that size. Eviction is GreedyDual-Size-Frequency over leaves: H = L + freq * cost / size,
  where a checkpoint's size is its bytes plus the KV path only it keeps reachable (up to a
  fork or another checkpoint), L rises to each victim's H, and a read bumps freq. An item
  that another stored item names as ``parent`` is no leaf: it goes only after its
  dependents. A KV block with nothing on or below it is a leaf worth L: it goes first.
* ``SimReader``: the tier's reader thread as one server on the simulated clock. A read runs
  on the store when it is submitted; its future completes once the simulated clock reaches
  start + bytes / read bandwidth (start: when the reader is free), so the request waits
  that long while the others run.
* ``SimDiskTier``: the engine's ``DiskTier`` over those two, its clock the simulation's
  (the write rate is a budget per simulated second).

Deterministic: no threads, no wall clock. Not modelled: an item evicted while its read is in
flight (the store is read at submission), the real store's bounded write queue (the rate
keeps writes below the disk's bandwidth), per-item latency and file-system block rounding.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from deltaserve.cache.disk_tier import DiskTier
from deltaserve.cache.types import DiskItemKind

KV, CHECKPOINT = DiskItemKind.KV, DiskItemKind.CHECKPOINT
# a path longer than this many blocks is priced as if it forked there (bounds each walk)
_MAX_PATH_BLOCKS = 1 << 14


@dataclass(slots=True)
class _Item:
    """One stored item: its accounted size and its GDSF state."""

    kind: DiskItemKind
    key: int
    parent: int  # the KV block it depends on (0: none); a checkpoint's is its own key
    size: int
    cost: float  # tokens of prefill a hit through it saves (0 for KV)
    freq: int = 1
    base: float = 0.0  # L when it was last pushed (put, read, or made a leaf)
    h: float = 0.0  # its priority as last pushed
    gen: int = 0  # heap entries with another generation are stale


class SimStore:
    """An in-memory, size-accounted disk store with GDSF leaves-first eviction."""

    def __init__(self, capacity_bytes: int, *, kv_block_bytes: int, checkpoint_bytes: int) -> None:
        if capacity_bytes <= 0 or kv_block_bytes <= 0 or checkpoint_bytes <= 0:
            raise ValueError(
                "capacity_bytes, kv_block_bytes and checkpoint_bytes must be > 0, got "
                f"{capacity_bytes}, {kv_block_bytes}, {checkpoint_bytes}"
            )
        self.capacity = capacity_bytes
        self.sizes = {KV: kv_block_bytes, CHECKPOINT: checkpoint_bytes}
        self._payloads: dict[DiskItemKind, bytes] = {}  # one zero buffer per kind, made on first read
        self.items: dict[tuple[DiskItemKind, int], _Item] = {}
        # per KV key: how many stored items name it as parent (> 0: that block is no leaf)
        self.deps: dict[int, int] = {}
        self._heap: list[tuple[float, int, int, int, int]] = []  # (h, tie, gen, kind, key)
        self._tie = itertools.count()
        self.inflation = 0.0  # GDSF's L
        self.used = 0
        self.counters: dict[str, int] = dict.fromkeys(
            ("bytes_written", "bytes_read", "items_written", "items_read", "queue_drops",
             "evicted_items", "orphans_refused"), 0)  # fmt: skip

    # ------------------------------------------------------------------ the Store protocol
    def has(self, kind: DiskItemKind, key: int) -> bool:
        return (kind, key) in self.items

    def queued(self, kind: DiskItemKind, key: int) -> bool:
        return False  # a put lands at once

    def put(self, kind: DiskItemKind, key: int, parent: int, payload: bytes, cost: float) -> bool:
        """Store an item of ``kind``'s model size (``payload`` is not kept); False when it is
        there already, its parent is not stored (it could never be reached), or no room can
        be made."""
        if (kind, key) in self.items:
            return False
        if parent and (KV, parent) not in self.items:
            self.counters["orphans_refused"] += 1
            return False
        size = self.sizes[kind]
        if parent:  # counted first: making room must not evict the chain it hangs from
            self.deps[parent] = self.deps.get(parent, 0) + 1
        if size > self.capacity or not self._make_room(size):
            self._drop_dependent(parent)
            self.counters["queue_drops"] += 1
            return False
        item = _Item(kind, key, parent, size, float(cost))
        self.items[kind, key] = item
        self.used += size
        self._push(item)
        self.counters["items_written"] += 1
        self.counters["bytes_written"] += size
        return True

    def read(self, kind: DiskItemKind, key: int) -> bytes | None:
        """A buffer of the item's size (its content is not simulated), or None; bumps its freq."""
        item = self.items.get((kind, key))
        if item is None:
            return None
        item.freq += 1
        self._push(item)
        self.counters["items_read"] += 1
        self.counters["bytes_read"] += item.size
        buf = self._payloads.get(kind)
        if buf is None:
            buf = self._payloads[kind] = bytes(item.size)
        return buf

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "disk.items": len(self.items),
            "disk.bytes": self.used,
            "disk.capacity_bytes": self.capacity,
            "disk.queue_items": 0,
            "disk.queue_bytes": 0,
        }
        out.update({f"disk.{k}": v for k, v in self.counters.items()})
        return out

    def close(self) -> None:
        pass

    def check_integrity(self) -> None:
        """Bytes and dependents agree with the items; every parent is stored; within capacity."""
        assert self.used == sum(i.size for i in self.items.values()) <= self.capacity, "disk bytes"
        deps = Counter(i.parent for i in self.items.values() if i.parent)
        assert deps == Counter(self.deps), "disk dependents"
        for i in self.items.values():
            assert not i.parent or (KV, i.parent) in self.items, f"disk item {i.key:x} lost its parent"

    # ------------------------------------------------------------------ eviction
    def _exclusive_size(self, item: _Item) -> int:
        """A checkpoint's bytes plus the KV blocks above it that nothing else depends on."""
        total, key = item.size, item.parent
        for _ in range(_MAX_PATH_BLOCKS):
            kv = self.items.get((KV, key)) if key else None
            if kv is None or self.deps.get(key, 0) != 1:
                break
            total += kv.size
            key = kv.parent
        return total

    def _value(self, item: _Item) -> float:
        if item.kind is KV or item.cost <= 0:
            return item.base  # a KV block is worth the checkpoints that depend on it
        return item.base + item.freq * item.cost / self._exclusive_size(item)

    def _is_leaf(self, item: _Item) -> bool:
        return item.kind is CHECKPOINT or item.key not in self.deps

    def _push(self, item: _Item) -> None:
        """Re-rank ``item`` at the current L (a leaf only); its older heap entries go stale."""
        item.gen += 1
        if not self._is_leaf(item):
            return
        item.base = self.inflation
        item.h = self._value(item)
        heapq.heappush(self._heap, (item.h, next(self._tie), item.gen, int(item.kind), item.key))
        if len(self._heap) > 4 * len(self.items) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale heap entries."""
        live = [e for e in self._heap if (i := self.items.get((DiskItemKind(e[3]), e[4]))) and i.gen == e[2]]
        heapq.heapify(live)
        self._heap = live

    def _victim(self) -> _Item | None:
        while self._heap:
            h, _, gen, kind, key = heapq.heappop(self._heap)
            item = self.items.get((DiskItemKind(kind), key))
            if item is None or item.gen != gen or not self._is_leaf(item):
                continue
            now = self._value(item)
            if now > h:  # a fork appeared above it since: its own path, so its bytes, shrank
                item.h = now
                heapq.heappush(self._heap, (now, next(self._tie), gen, kind, key))
                continue
            self.inflation = max(self.inflation, h)
            return item
        return None

    def _make_room(self, size: int) -> bool:
        while self.used + size > self.capacity:
            victim = self._victim()
            if victim is None:
                return False
            del self.items[victim.kind, victim.key]
            self.used -= victim.size
            victim.gen += 1
            self._drop_dependent(victim.parent)
            self.counters["evicted_items"] += 1
        return True

    def _drop_dependent(self, parent: int) -> None:
        """One dependent of KV block ``parent`` is gone; with none left it is a leaf."""
        if not parent:
            return
        left = self.deps[parent] - 1
        if left:
            self.deps[parent] = left
            return
        del self.deps[parent]
        kv = self.items.get((KV, parent))
        if kv is not None:
            self._push(kv)


class SimReader(Executor):
    """The disk tier's reader thread as one server on the simulated clock (module docstring)."""

    def __init__(self, store: SimStore, read_bytes_per_s: float, clock: Callable[[], float]) -> None:
        if read_bytes_per_s <= 0:
            raise ValueError(f"read_bytes_per_s must be > 0, got {read_bytes_per_s}")
        self.store, self.rate, self.clock = store, read_bytes_per_s, clock
        self.free_at = 0.0  # when the reader has finished what it was given
        self.busy_s = 0.0
        self._due: list[tuple[float, int, Future[Any], Any]] = []  # (done at, tie, future, result)
        self._tie = itertools.count()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        before = self.store.counters["bytes_read"]
        try:
            result = fn(*args, **kwargs)
        except Exception as e:  # (a bug in the read surfaces where the tier collects it)
            future.set_exception(e)
            return future
        seconds = (self.store.counters["bytes_read"] - before) / self.rate
        start = max(self.clock(), self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        future.set_running_or_notify_cancel()
        heapq.heappush(self._due, (self.free_at, next(self._tie), future, result))
        return future

    @property
    def next_due(self) -> float | None:
        """When the next read in flight completes (None: none in flight)."""
        return self._due[0][0] if self._due else None

    def advance(self, now: float) -> None:
        """Complete the reads due by ``now``."""
        while self._due and self._due[0][0] <= now:
            _, _, future, result = heapq.heappop(self._due)
            future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.advance(float("inf"))


class SimDiskTier(DiskTier):
    """``DiskTier`` over a ``SimStore``, reading through a ``SimReader`` on ``clock``."""

    def __init__(
        self, store: SimStore, *, read_bytes_per_s: float, clock: Callable[[], float], **kw: Any
    ) -> None:
        self.reader = SimReader(store, read_bytes_per_s, clock)
        super().__init__(store, clock=clock, reader=self.reader, **kw)
        self.sim_store = store
