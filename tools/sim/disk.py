"""The disk tier in the simulator: an in-memory store and a reader on the simulated clock.

* ``SimStore``: the ``Store`` protocol of ``cache/disk_tier.py`` with no I/O and no payloads
  kept (the simulator's copies carry no bytes). Capacity is accounted in the simulated
  model's item sizes (one KV block, one checkpoint), and ``read`` returns a shared buffer of
  that size. Eviction is GreedyDual-Size-Frequency over leaves: H = L + freq * cost / size,
  where a checkpoint's size is its bytes plus the KV path only it keeps reachable (up to a
  fork or another checkpoint), L rises to each victim's H, and a read bumps freq. An item
  that another stored item names as ``parent`` is no leaf: it goes only after its
  dependents. A KV block with nothing on or below it is a leaf worth L: it goes first. The
  rule is ``cache/disk_index.py``'s, the one the real store uses.
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
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from deltaserve.cache.disk_index import DiskEntry, DiskIndex
from deltaserve.cache.disk_tier import DiskTier
from deltaserve.cache.types import DiskItemKind

KV, CHECKPOINT = DiskItemKind.KV, DiskItemKind.CHECKPOINT


class SimStore:
    """An in-memory, size-accounted disk store with the real store's eviction (``DiskIndex``)."""

    def __init__(self, capacity_bytes: int, *, kv_block_bytes: int, checkpoint_bytes: int) -> None:
        if capacity_bytes <= 0 or kv_block_bytes <= 0 or checkpoint_bytes <= 0:
            raise ValueError(
                "capacity_bytes, kv_block_bytes and checkpoint_bytes must be > 0, got "
                f"{capacity_bytes}, {kv_block_bytes}, {checkpoint_bytes}"
            )
        self.capacity = capacity_bytes
        self.sizes = {KV: kv_block_bytes, CHECKPOINT: checkpoint_bytes}
        self._payloads: dict[DiskItemKind, bytes] = {}  # one zero buffer per kind, made on first read
        self.index = DiskIndex(capacity_bytes)
        self.counters: dict[str, int] = dict.fromkeys(
            ("bytes_written", "bytes_read", "items_written", "items_read", "queue_drops",
             "evicted_items", "orphans_refused"), 0)  # fmt: skip

    @property
    def items(self) -> list[tuple[DiskItemKind, int]]:
        """(kind, key) of every stored item, oldest first."""
        return list(self.index)

    @property
    def used(self) -> int:
        return self.index.used

    @property
    def inflation(self) -> float:
        """GDSF's L."""
        return self.index.inflation

    # ------------------------------------------------------------------ the Store protocol
    def has(self, kind: DiskItemKind, key: int) -> bool:
        return (kind, key) in self.index

    def queued(self, kind: DiskItemKind, key: int) -> bool:
        return False  # a put lands at once

    def put(self, kind: DiskItemKind, key: int, parent: int, payload: bytes, cost: float) -> bool:
        """Store an item of ``kind``'s model size (``payload`` is not kept); False when it is
        there already, its parent is not stored (it could never be reached), or no room can
        be made."""
        if (kind, key) in self.index:
            return False
        if parent and (KV, parent) not in self.index:
            self.counters["orphans_refused"] += 1
            return False
        size = self.sizes[kind]
        self.index.depend(parent)  # first: making room must not evict the chain it hangs from
        victims, fits = self.index.make_room(size)
        self.counters["evicted_items"] += len(victims)
        if not fits:
            self.index.undepend(parent)
            self.counters["queue_drops"] += 1
            return False
        self.index.add(DiskEntry(kind, key, parent, size, size, float(cost)))
        self.counters["items_written"] += 1
        self.counters["bytes_written"] += size
        return True

    def read(self, kind: DiskItemKind, key: int) -> bytes | None:
        """A buffer of the item's size (its content is not simulated), or None; bumps its freq."""
        item = self.index.get(kind, key)
        if item is None:
            return None
        self.index.touch(item)
        self.counters["items_read"] += 1
        self.counters["bytes_read"] += item.size
        buf = self._payloads.get(kind)
        if buf is None:
            buf = self._payloads[kind] = bytes(item.size)
        return buf

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "disk.items": len(self.index),
            "disk.bytes": self.index.used,
            "disk.capacity_bytes": self.capacity,
            "disk.queue_items": 0,
            "disk.queue_bytes": 0,
        }
        out.update({f"disk.{k}": v for k, v in self.counters.items()})
        return out

    def close(self) -> None:
        pass

    def check_integrity(self) -> None:
        """The index's invariants, and every parent is stored (orphans are refused)."""
        self.index.check_integrity()
        for i in self.index.entries():
            assert not i.parent or (KV, i.parent) in self.index, f"disk item {i.key:x} lost its parent"


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
