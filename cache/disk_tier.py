"""The disk tier: what the cache reads from and writes to the persistent store.

An *inclusive*, content-addressed tier below the tree: items are keyed by their chained block
hash (``cache/hashing.py``), so the tree knows nothing of them and a restarted engine, whose
tree is empty, finds what the last run wrote. The store (``cache/disk_store.py``) holds the
bytes; this part decides what goes there and which hits come back. Torch-free.

* **Writes.** Every checkpoint published on the device is a write-through candidate (newest
  first), written with the KV blocks of its path the disk does not hold yet, under a byte
  rate (``write_bytes_per_s``): a crash loses little. A checkpoint leaving the last tier
  above (dropped by the device with no room on the host, or evicted by the host) is written
  back if it is not there yet, under the same rate. Writes are planned as ``DiskSave`` items
  of the next step (``take_saves``: copied out first in that step, before anything reuses the
  bytes they read); the store's writer thread puts them on disk, and a full queue drops.
* **Reads.** ``fetch`` extends a prompt's tree hit from disk: the KV blocks after it that the
  disk holds, and the deepest checkpoint on them at a checkpoint unit (at most the prompt
  less one token). A reader thread of a small pool (``cache/disk_reader.py``) reads and
  verifies them before the request is admitted (a damaged or missing item shortens the hit,
  never changes an output); meanwhile the request waits and the others run. The admitted
  request then loads them into its private blocks and live slot like host loads
  (``TransferKind.DISK_*``), and publishes them as if computed.
* **Deadline.** A fetch not read within ``read_timeout_s`` (None: no deadline) is given up
  (``disk.read_timeouts``): its request goes on without it and computes; what the stuck read
  returns later is never used. So one stuck read (a stalled filesystem) holds one reader
  thread, never another request. ``close`` does not wait for reads.

Invariant: a fetch is read whole before it is used; its buffers count against
``read_buffer_bytes`` until its request is admitted or gone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field
from typing import Protocol

from deltaserve.cache.disk_reader import ReaderPool
from deltaserve.cache.radix_tree import Node
from deltaserve.cache.types import DiskItemKind, DiskSave, Tier
from deltaserve.logs import get_logger

log = get_logger("deltaserve.cache")

KV, CHECKPOINT = DiskItemKind.KV, DiskItemKind.CHECKPOINT


class Store(Protocol):
    """What the disk tier needs of a store (``cache/disk_store.DiskStore``; a dict in tests)."""

    def has(self, kind: DiskItemKind, key: int) -> bool: ...
    def queued(self, kind: DiskItemKind, key: int) -> bool: ...
    def put(self, kind: DiskItemKind, key: int, parent: int, payload: bytes, cost: float) -> bool: ...
    def read(self, kind: DiskItemKind, key: int) -> bytes | None: ...
    def stats(self) -> dict[str, int | float]: ...
    def close(self) -> None: ...


@dataclass(eq=False)
class DiskFetch:
    """One request's disk hit, read on the reader thread: KV of blocks ``start_block ..
    end_block`` and the checkpoint at ``end_block`` (``end_block == 0``: no hit)."""

    request_id: str
    start_block: int  # the tree hit (in blocks) it extends
    keys: list[int]  # the prompt's block hashes (shared with the request)
    boundaries: list[int]  # candidate checkpoint ends, in blocks, deepest first
    nbytes: int  # bytes reserved for its buffers
    since: float
    deadline: float | None = None  # on the tier's clock; given up past it
    future: Future[None] | None = None
    end_block: int = 0
    kv: list[bytes] = field(default_factory=list)
    state: bytes | None = None
    timed_out: bool = False  # given up: a miss, whatever its read returns later

    @property
    def done(self) -> bool:
        return self.timed_out or self.future is None or self.future.done()


class DiskTier:
    def __init__(
        self,
        store: Store,
        *,
        block_size: int,
        unit_blocks: int,
        kv_block_bytes: int,
        checkpoint_bytes: int,
        write_bytes_per_s: float | None = None,
        read_buffer_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
        reader: Executor | None = None,  # where reads run (default: a ReaderPool; the simulator's clock)
        read_timeout_s: float | None = None,  # a fetch not read by then is a miss (None: no deadline)
    ) -> None:
        if read_timeout_s is not None and not read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0 or None, got {read_timeout_s}")
        self.store = store
        self.block_size = block_size
        self.unit_blocks = unit_blocks
        self.kv_block_bytes = kv_block_bytes
        self.checkpoint_bytes = checkpoint_bytes
        self.rate = write_bytes_per_s
        self.read_buffer_bytes = read_buffer_bytes
        self.clock = clock
        self.read_timeout_s = read_timeout_s
        self._timeout_logged_at: float | None = None
        self._allowance = float(write_bytes_per_s or 0.0)  # a token bucket of one second
        self._refilled = clock()
        self._reader = reader or ReaderPool()
        self.fetches: dict[str, DiskFetch] = {}
        self._gave_up: set[str] = set()  # requests whose read found nothing (until they end)
        self._lost: dict[str, str] = {}  # request id -> why its last disk hit was given up
        self.buffered = 0  # bytes reserved by fetches
        self.pending: deque[Node] = deque(maxlen=4096)  # write-through candidates, newest last
        self.saves: list[DiskSave] = []
        self._planned: set[tuple[DiskItemKind, int]] = set()  # planned, not yet handed to the store
        self.counters: dict[str, int] = dict.fromkeys(
            ("disk.fetches", "disk.fetch_damaged", "disk.fetch_refused", "disk.read_wait_ms",
             "disk.read_timeouts", "disk.saves_planned", "disk.saves_skipped_rate",
             "disk.write_backs"), 0)  # fmt: skip

    # ------------------------------------------------------------------ reads
    def probe(self, keys: list[int], hit_blocks: int, max_blocks: int) -> tuple[int, list[int]]:
        """The KV run on disk after ``hit_blocks`` (its end, in blocks) and the checkpoint
        boundaries on it, deepest first (at most ``max_blocks``, beyond ``hit_blocks``)."""
        has = self.store.has
        end = hit_blocks
        limit = min(max_blocks, len(keys))
        while end < limit and has(KV, keys[end]):
            end += 1
        u = self.unit_blocks
        top = end // u * u
        bounds = [b for b in range(top, hit_blocks, -u) if has(CHECKPOINT, keys[b - 1])]
        return end, bounds[:3]  # a damaged deepest one falls back to the next

    def fetch(self, request_id: str, keys: list[int], hit_blocks: int, max_blocks: int) -> DiskFetch | None:
        """The request's disk hit, being read or read; None when the disk adds nothing (or its
        buffers are full: the request goes on without it)."""
        f = self._fetch_in_hand(request_id, hit_blocks)
        if f is not None or request_id in self._gave_up:
            return f
        _, bounds = self.probe(keys, hit_blocks, max_blocks)
        if not bounds:
            return None
        return self._start_fetch(request_id, keys, hit_blocks, bounds)

    def _fetch_in_hand(self, request_id: str, hit_blocks: int) -> DiskFetch | None:
        """The request's fetch while it still serves a hit at ``hit_blocks``; else None, a spent
        one discarded (and given up on when it found nothing or timed out: no second try, no
        livelock; when the tree moved under it, the caller reads again from the new hit)."""
        f = self.fetches.get(request_id)
        if f is None:
            return None
        self._check_deadline(f)
        if not f.timed_out and f.start_block <= hit_blocks and (not f.done or f.end_block > hit_blocks):
            return f
        self.discard(request_id)
        if f.end_block == 0 or f.timed_out:
            self._gave_up.add(request_id)
        return None

    def _start_fetch(
        self, request_id: str, keys: list[int], hit_blocks: int, bounds: list[int]
    ) -> DiskFetch | None:
        """A read of the path past ``hit_blocks`` to its deepest boundary in ``bounds`` (deepest
        first), on the reader thread; None when the read buffers cannot take it."""
        nbytes = (bounds[0] - hit_blocks) * self.kv_block_bytes + self.checkpoint_bytes
        if self.buffered + nbytes > self.read_buffer_bytes:
            self.counters["disk.fetch_refused"] += 1
            self._lost[request_id] = "read_budget"
            return None
        self._lost.pop(request_id, None)
        now = self.clock()
        deadline = None if self.read_timeout_s is None else now + self.read_timeout_s
        f = DiskFetch(request_id, hit_blocks, keys, bounds, nbytes, now, deadline)
        self.buffered += nbytes
        self.fetches[request_id] = f
        self.counters["disk.fetches"] += 1
        f.future = self._reader.submit(self._read, f)
        return f

    def _read(self, f: DiskFetch) -> None:
        """Reader thread: the KV blocks in order up to the first missing or damaged one, then
        the deepest checkpoint that they reach and that verifies."""
        read = self.store.read
        kv: list[bytes] = []
        for key in f.keys[f.start_block : f.boundaries[0]]:
            if f.timed_out:  # given up: the rest would be read for nothing
                return
            data = read(KV, key)
            if data is None or len(data) != self.kv_block_bytes:
                break
            kv.append(data)
        reached = f.start_block + len(kv)
        for b in f.boundaries:
            if b > reached:
                continue
            state = read(CHECKPOINT, f.keys[b - 1])
            if f.timed_out:
                return
            if state is not None and len(state) == self.checkpoint_bytes:
                f.kv, f.state = kv[: b - f.start_block], state
                f.end_block = b  # (last: the step thread reads it once ``done``)
                return

    def _check_deadline(self, f: DiskFetch) -> None:
        """Give ``f`` up if its read is still running past its deadline (counted; logged at
        most once a minute: a stalled filesystem would log every request)."""
        if f.timed_out or f.done or f.deadline is None:
            return
        now = self.clock()
        if now < f.deadline:
            return
        f.timed_out = True
        self._lost[f.request_id] = "disk_wait"
        if f.future is not None:
            f.future.cancel()  # (if it has not started; a running read finishes into nothing)
        self.counters["disk.read_timeouts"] += 1
        if self._timeout_logged_at is None or now - self._timeout_logged_at >= 60.0:
            self._timeout_logged_at = now
            log.warning(
                "disk.read_timeout",
                request_id=f.request_id,
                timeout_s=self.read_timeout_s,
                read_timeouts=self.counters["disk.read_timeouts"],
            )

    def usable(self, f: DiskFetch, hit_blocks: int) -> bool:
        """``f`` has been read and extends a tree hit of ``hit_blocks``."""
        self._check_deadline(f)
        if f.timed_out or not f.done:
            return False
        if f.future is not None:
            f.future.result()  # (a bug in the reader surfaces here, not as a silent miss)
            self.counters["disk.read_wait_ms"] += round(1000 * (self.clock() - f.since))
            self.counters["disk.fetch_damaged"] += f.end_block == 0
            f.future = None
        return f.start_block <= hit_blocks < f.end_block

    def wait(self, timeout: float) -> None:
        """Block until a read in flight finishes, at most ``timeout`` seconds."""
        running = [f.future for f in self.fetches.values() if f.future is not None and not f.future.done()]
        if running:
            wait(running, timeout=timeout, return_when=FIRST_COMPLETED)

    def given_up(self, request_id: str) -> str | None:
        """Why the request's disk hit was last given up: ``read_budget`` (its fetch found the
        read buffers full), ``disk_wait`` (read past the deadline); None if it was not."""
        return self._lost.get(request_id)

    def forget(self, request_id: str) -> None:
        """The request has ended (or left the queue): its fetch and its marks go."""
        self.discard(request_id)
        self._gave_up.discard(request_id)
        self._lost.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        """Forget a request's fetch (used, or the request is gone); a read still running
        finishes into nothing."""
        f = self.fetches.pop(request_id, None)
        if f is not None:
            self.buffered -= f.nbytes
            f.kv, f.state = [], None

    # ------------------------------------------------------------------ writes
    def note_checkpoint(self, node: Node) -> None:
        """A checkpoint was published on the device: a write-through candidate."""
        self.pending.append(node)

    def write_back(self, node: Node, tier: Tier, slot: int) -> None:
        """``node``'s checkpoint leaves the last tier that held it (``slot`` in ``tier``,
        already detached; its bytes are intact until the next step's copies): keep it."""
        if self._plan(node, tier, slot):
            self.counters["disk.write_backs"] += 1

    def plan_writes(self) -> None:
        """Write-through: the newest published checkpoints the disk lacks, under the rate."""
        while self.pending and self._budget() > 0:
            node = self.pending.pop()
            if node.parent is not None and node.checkpoint_slot is not None:
                self._plan(node, Tier.DEVICE, node.checkpoint_slot)

    def take_saves(self) -> list[DiskSave]:
        """The saves planned since the last call (for the step being planned)."""
        saves, self.saves = self.saves, []
        self._planned.clear()  # the step copies them out and hands them to the store next
        return saves

    def _budget(self) -> float:
        if self.rate is None:
            return float("inf")
        now = self.clock()
        self._allowance = min(self.rate, self._allowance + (now - self._refilled) * self.rate)
        self._refilled = now
        return self._allowance

    def _known(self, kind: DiskItemKind, key: int) -> bool:
        return (kind, key) in self._planned or self.store.has(kind, key) or self.store.queued(kind, key)

    def _plan(self, node: Node, tier: Tier, slot: int) -> bool:
        """Plan ``node``'s checkpoint and the KV of its path the disk lacks; False when it is
        there already, a block of its path cannot be read now, or the rate is spent."""
        if self._known(CHECKPOINT, node.key):
            return False
        path: list[tuple[Node, Tier, int]] = []
        n: Node | None = node
        while n is not None and n.parent is not None and not self._known(KV, n.key):
            if n.moving:
                return False  # being copied between tiers: no stable bytes to read
            if n.block_id >= 0:
                path.append((n, Tier.DEVICE, n.block_id))
            elif n.host_block >= 0:
                path.append((n, Tier.HOST, n.host_block))
            else:
                return False
            n = n.parent
        nbytes = len(path) * self.kv_block_bytes + self.checkpoint_bytes
        # an item larger than a second's worth goes when the bucket is full (then below 0)
        if self._budget() < min(nbytes, self.rate if self.rate is not None else nbytes):
            self.counters["disk.saves_skipped_rate"] += 1
            return False
        if self.rate is not None:
            self._allowance -= nbytes
        for kv_node, kv_tier, block in reversed(path):  # parents first
            parent = (
                kv_node.parent.key if kv_node.parent is not None and kv_node.parent.parent is not None else 0
            )
            self._add(DiskSave(KV, kv_node.key, parent, kv_tier, block, 0.0))
        self._add(DiskSave(CHECKPOINT, node.key, node.key, tier, slot, float(node.depth * self.block_size)))
        return True

    def _add(self, save: DiskSave) -> None:
        self._planned.add((save.kind, save.key))
        self.saves.append(save)
        self.counters["disk.saves_planned"] += 1

    # ------------------------------------------------------------------ persist all
    def plan_all(self, nodes: Iterable[Node]) -> int:
        """Plan every checkpoint in ``nodes`` the disk lacks, ignoring the rate (a graceful
        shutdown); how many were planned."""
        rate, self.rate = self.rate, None
        try:
            planned = 0
            for node in nodes:
                if node.checkpoint_slot is not None:
                    planned += self._plan(node, Tier.DEVICE, node.checkpoint_slot)
                elif node.host_slot is not None and not node.ckpt_moving:
                    planned += self._plan(node, Tier.HOST, node.host_slot)
            return planned
        finally:
            self.rate = rate

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.counters)
        out.update(self.store.stats())
        out["disk.read_buffer_bytes"] = self.buffered
        return out

    def close(self) -> None:
        """Stop the reader without waiting for a read in flight (it finishes into nothing:
        the store serves nothing once closed) and close the store (it flushes)."""
        self._reader.shutdown(wait=False, cancel_futures=True)
        for rid in list(self.fetches):
            self.discard(rid)
        self.store.close()
