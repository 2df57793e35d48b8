"""The disk store: the storage layer of the disk tier (torch-free, opaque byte payloads).

Items are byte payloads of two kinds (``ItemKind``: a KV block, a GDN checkpoint) keyed by
128-bit ints (the chained block hashes). Contract:

* ``put`` never waits on disk: it hands the item to the writer threads through a queue
  bounded in items and bytes, and returns False (a counted drop) when it cannot take it.
* An item is served by ``read`` only if it verifies (header checksum, kind, key, length and
  the xxh3-64 of the payload); anything else is a miss, counted and forgotten, never an
  exception. A kill -9 at any moment leaves only complete items under their final names
  (each is written to ``tmp/`` and renamed into place); leftovers are removed at open.
* ``capacity_bytes`` bounds the accounted bytes (payload + header rounded up to whole 4 KiB
  filesystem blocks). Eviction is GreedyDual-Size-Frequency over *leaves* only: an item that
  another stored or queued item depends on (its ``parent``) stays until its dependents go.
* One process at a time: ``flock`` on ``<path>/lock``; a second opener gets ``DiskStoreLocked``.
* A store is reused only if its manifest's ``StoreIdentity`` equals the caller's; otherwise
  its contents are moved to ``<path>/set-aside-<utc stamp>/`` and a warning names the fields
  that differ.

Layout (one file per item; ``tools/bench_disk_store.py`` measures it against segment files
and sqlite): ``manifest.json``; ``items/<first byte of key>/<kind>-<key>-<parent>-<length>-
<cost>`` (hex; a file's name carries all the index needs, so an open lists the directories
and opens no item); ``tmp/`` (writes in progress, emptied at open); ``index.bin``
(frequencies and GDSF's L saved at close; without it, after a crash, items restart at
frequency 1).

Why files and not segments: at steady state a cache store is full and evicts by value, not
by age, so a segment layout must compact (copy live records) to reclaim space: modelled with
greedy compaction (``bench_disk_store.py --amplification``) it copies 1.6 records per record
written with 20 % of the disk left to dead records, 3.9 with 10 %. One file per item frees
space with an unlink, uses the whole capacity and needs no compaction. Measured here,
writing 10 GB of 0.8B-shaped items (one 19 MiB checkpoint per 32 384-KiB blocks): files
with two writers 28.7 s, segments 33.0 s before any compaction (with one writer, files took
80 s against 41 s: file creation waits, so two writers overlap it). Small items are this
layout's weak spot (16 KiB: tens of MB/s against hundreds for segment appends), which only
the built-in tiny model has. An open is a directory listing, ~18 us per item: 65 ms for the
10 GB above (11 k files), about 12 s for 10 GB of 16 KiB items (655 k files).

fsync policy: none per item. A crash of the process cannot tear a renamed file (its writes
are in the page cache before the rename); a power loss can, and then the payload checksum
fails and the item is a miss. Durability of the last items across a power loss is not
promised. ``manifest.json`` and ``index.bin`` are fsynced before their rename (rare writes).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import heapq
import math
import os
import shutil
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import msgspec
import xxhash

from deltaserve.logs import get_logger

log = get_logger("deltaserve.cache")

FORMAT_VERSION = 1

_MAGIC = b"DSI1"
# magic, format, kind, reserved, key, parent, payload length, cost, payload xxh3_64
_HEAD_BODY = struct.Struct("<4sHBB16s16sQdQ")
_HEAD_SUM = struct.Struct("<Q")  # xxh3_64 of the body: a torn header never parses
HEADER_BYTES = _HEAD_BODY.size + _HEAD_SUM.size
FS_BLOCK = 4096
_FANOUT_BITS = 8  # 256 item directories: ~2.5 k files each for 10 GB of 16 KiB items

_INDEX_MAGIC = b"DSX1"
_INDEX_HEAD = struct.Struct("<4sHQdQ")  # magic, format, count, L, xxh3_64 of the records
_INDEX_REC = struct.Struct("<B16sQ")  # kind, key, freq
_MAX_CHAIN = 1 << 16  # bound on the walk for a checkpoint's exclusive KV path
_ERROR_LOG_INTERVAL_S = 60.0
_KEY_LIMIT = 1 << 128
# Writer threads: creating a file costs this filesystem 0.3 ms idle and several ms under
# writeback pressure, mostly waiting (GIL released); two writers overlap those waits.
WRITER_THREADS = 2


class ItemKind(enum.IntEnum):
    KV = 1
    CHECKPOINT = 2


class StoreIdentity(msgspec.Struct, frozen=True):
    """What must match for a store to be reused: else it is set aside, never mixed."""

    model: str  # hash of the model config
    weights: str  # weights fingerprint
    dtype: str
    block_size: int
    gdn_chunk_size: int
    salt_rule: str  # how cache salts/namespaces are formed (a version string)
    kv_block_bytes: int
    checkpoint_bytes: int
    format: int = FORMAT_VERSION  # the on-disk format of this module

    def __post_init__(self) -> None:
        for name in ("block_size", "gdn_chunk_size", "kv_block_bytes", "checkpoint_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"StoreIdentity.{name} must be > 0, got {getattr(self, name)}")


class Manifest(msgspec.Struct, frozen=True):
    identity: StoreIdentity
    created: float  # unix time the store was created


class DiskStoreError(Exception):
    """The disk store cannot be opened as asked: an identity whose ``format`` is not this
    module's, a path that cannot be locked or created. Raised by ``DiskStore(...)`` only;
    I/O errors after the open are never raised (a write drops, a read misses)."""


class DiskStoreLocked(DiskStoreError):
    """Another ``DiskStore`` (in this process or another) holds the path's lock: one store
    per path at a time. The message names the path."""


@dataclass(slots=True)
class _Entry:
    kind: ItemKind
    key: int
    parent: int
    length: int  # payload bytes
    size: int  # accounted bytes on disk
    cost: float
    freq: int
    base: float = 0.0  # GDSF's L when the item was last written, read or made a leaf
    h: float = 0.0  # GDSF priority as last pushed
    gen: int = 0  # heap entries with another gen are stale


@dataclass(slots=True)
class _Pending:
    kind: ItemKind
    key: int
    parent: int
    payload: bytes
    cost: float


def accounted_bytes(length: int) -> int:
    """Bytes an item of ``length`` payload bytes costs on disk: header + data, whole blocks."""
    return -(-(HEADER_BYTES + length) // FS_BLOCK) * FS_BLOCK


def encode_header(kind: ItemKind, key: int, parent: int, payload: bytes, cost: float) -> bytes:
    body = _HEAD_BODY.pack(
        _MAGIC,
        FORMAT_VERSION,
        int(kind),
        0,
        key.to_bytes(16, "little"),
        parent.to_bytes(16, "little"),
        len(payload),
        cost,
        xxhash.xxh3_64_intdigest(payload),
    )
    return body + _HEAD_SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(raw: bytes) -> tuple[ItemKind, int, int, int, float, int] | None:
    """(kind, key, parent, length, cost, payload checksum), or None if not a valid header."""
    if len(raw) < HEADER_BYTES:
        return None
    body = raw[: _HEAD_BODY.size]
    (checksum,) = _HEAD_SUM.unpack_from(raw, _HEAD_BODY.size)
    if xxhash.xxh3_64_intdigest(body) != checksum:
        return None
    magic, fmt, kind, _, key, parent, length, cost, psum = _HEAD_BODY.unpack(body)
    if magic != _MAGIC or fmt != FORMAT_VERSION or kind not in (1, 2):
        return None
    return (
        ItemKind(kind),
        int.from_bytes(key, "little"),
        int.from_bytes(parent, "little"),
        length,
        cost,
        psum,
    )


def item_name(kind: ItemKind, key: int, parent: int, length: int, cost: float) -> str:
    """An item's file name: everything the index needs, so an open reads no file."""
    return f"{int(kind)}-{key:032x}-{parent:032x}-{length:x}-{cost.hex()}"


_KIND_OF_DIGIT = {"1": ItemKind.KV, "2": ItemKind.CHECKPOINT}


def parse_item_name(name: str) -> tuple[ItemKind, int, int, int, float] | None:
    """The fields ``item_name`` wrote, or None for any other name."""
    parts = name.split("-", 4)  # the cost's hex exponent may hold a '-'
    kind = _KIND_OF_DIGIT.get(parts[0])
    if kind is None or len(parts) != 5 or len(parts[1]) != 32 or len(parts[2]) != 32:
        return None
    try:
        key, parent, length = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
        cost = float.fromhex(parts[4])
    except ValueError:
        return None
    if not (math.isfinite(cost) and cost >= 0 and key >= 0 and parent >= 0 and length >= 0):
        return None
    return kind, key, parent, length, cost


def _length(e: _Entry | _Pending) -> int:
    return e.length if isinstance(e, _Entry) else len(e.payload)


def _write_file(path: str, header: bytes, payload: bytes) -> None:
    """Write ``header + payload`` to a new file (the writer thread's only payload I/O)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        total = len(header) + len(payload)
        done = os.writev(fd, [header, payload])
        if done < total:  # a short write (rare, very large payloads): finish the rest
            rest = memoryview(header + payload)[done:]
            while rest:
                rest = rest[os.write(fd, rest) :]
    finally:
        os.close(fd)


def _fsync_replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class DiskStore:
    """A bounded, crash-consistent, single-process store of KV blocks and checkpoints."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        identity: StoreIdentity,
        *,
        queue_items: int = 1024,
        queue_bytes: int = 256 << 20,
    ) -> None:
        if capacity_bytes <= 0 or queue_items <= 0 or queue_bytes <= 0:
            raise ValueError(
                f"capacity_bytes, queue_items and queue_bytes must be > 0, got "
                f"{capacity_bytes}, {queue_items}, {queue_bytes}"
            )
        if identity.format != FORMAT_VERSION:
            raise DiskStoreError(
                f"this module writes format {FORMAT_VERSION}, identity asks for {identity.format}"
            )
        t0 = time.perf_counter()
        self._path = Path(path)
        self._items_dir = str(self._path / "items")
        self._tmp_dir = str(self._path / "tmp")
        self._fan_dirs: set[int] = set()  # items/<xx> directories known to exist (writer's)
        self._capacity = capacity_bytes
        self._identity = identity
        self._queue_items = queue_items
        self._queue_bytes = queue_bytes
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index: dict[tuple[ItemKind, int], _Entry] = {}
        # number of stored *or queued* items whose parent is this key: a KV block with
        # dependents is not a leaf (queued ones count so that a chain is not evicted from
        # under a checkpoint that is still on its way to disk)
        self._deps: dict[int, int] = {}
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._inflate = 0.0  # GDSF's L
        self._used = 0
        self._queue: deque[_Pending] = deque()
        self._queued: set[tuple[ItemKind, int]] = set()
        self._queued_bytes = 0
        self._writing = 0  # items the writers hold between queue and index
        self._unlinking: set[tuple[ItemKind, int]] = set()  # evicted, file not yet gone
        self._closed = False
        self._counters = dict.fromkeys(
            (
                "bytes_written",
                "bytes_read",
                "items_written",
                "items_read",
                "queue_drops",
                "write_errors",
                "damaged_items",
                "evicted_items",
            ),
            0,
        )
        self._error_log_at: dict[str, float] = {}
        try:
            self._path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DiskStoreError(f"cannot create disk store {self._path}: {e}") from e
        self._lock_fd = self._take_lock()
        try:
            self._set_aside: Path | None = None
            self._created = self._open_manifest()
            self._prepare_dirs()
            self._load_index()
        except OSError as e:
            os.close(self._lock_fd)
            raise DiskStoreError(f"cannot open disk store {self._path}: {e}") from e
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._opened_in_ms = (time.perf_counter() - t0) * 1e3
        self._writers = [
            threading.Thread(target=self._run_writer, name=f"disk-store-writer-{i}", daemon=True)
            for i in range(WRITER_THREADS)
        ]
        for t in self._writers:
            t.start()
        log.info(
            "disk_store.opened",
            path=str(self._path),
            items=len(self._index),
            bytes=self._used,
            capacity=self._capacity,
            opened_in_ms=round(self._opened_in_ms, 1),
        )

    # ------------------------------------------------------------------ open
    def _take_lock(self) -> int:
        try:
            fd = os.open(self._path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DiskStoreError(f"cannot lock disk store {self._path}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DiskStoreLocked(
                    f"disk store {self._path} is in use by another DiskStore (lock held)"
                ) from e
            raise DiskStoreError(f"cannot lock disk store {self._path}: {e}") from e
        return fd

    def _open_manifest(self) -> float:
        """The store's creation time; sets a foreign or unreadable store aside first."""
        mpath = self._path / "manifest.json"
        contents = [
            p for p in self._path.iterdir() if p.name != "lock" and not p.name.startswith("set-aside-")
        ]
        old: Manifest | None = None
        reason = "empty"
        if contents:
            try:
                old = msgspec.json.decode(mpath.read_bytes(), type=Manifest)
                reason = "identity differs"
            except (OSError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                reason = f"manifest unreadable: {type(e).__name__}"
        if old is not None and old.identity == self._identity:
            return old.created
        if contents:
            self._set_aside_contents(contents, old, reason)
        created = time.time()
        manifest = Manifest(identity=self._identity, created=created)
        _fsync_replace(mpath, msgspec.json.encode(manifest))
        return created

    def _set_aside_contents(self, contents: list[Path], old: Manifest | None, reason: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest = self._path / f"set-aside-{stamp}"
        n = 1
        while dest.exists():
            n += 1
            dest = self._path / f"set-aside-{stamp}-{n}"
        dest.mkdir()
        for p in contents:
            p.rename(dest / p.name)
        self._set_aside = dest
        differs: dict[str, object] = {}
        if old is not None:
            mine = msgspec.structs.asdict(self._identity)
            theirs = msgspec.structs.asdict(old.identity)
            differs = {k: {"store": theirs[k], "ours": v} for k, v in mine.items() if theirs[k] != v}
        log.warning(
            "disk_store.set_aside",
            path=str(self._path),
            set_aside=str(dest),
            reason=reason,
            differs=differs,
        )

    def _prepare_dirs(self) -> None:
        tmp = self._path / "tmp"
        if tmp.exists():  # partial writes of a crashed process
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(exist_ok=True)
        (self._path / "items").mkdir(exist_ok=True)  # its fan-out directories come on demand

    def _item_path(self, e: _Entry | _Pending) -> str:
        name = item_name(e.kind, e.key, e.parent, _length(e), e.cost)
        return os.path.join(self._items_dir, f"{e.key >> (128 - _FANOUT_BITS):02x}", name)

    def _list_items(self) -> None:
        """Index every item file by its name alone (no file is opened); foreign files go."""
        for sub in os.scandir(self._items_dir):
            try:
                fan = int(sub.name, 16) if len(sub.name) == 2 else -1
            except ValueError:
                fan = -1
            if fan >= 0:
                self._fan_dirs.add(fan)
            for entry in os.scandir(sub.path):
                parsed = parse_item_name(entry.name)
                if parsed is None or (parsed[1] >> (128 - _FANOUT_BITS)) != fan:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    continue
                kind, key, parent, length, cost = parsed
                e = _Entry(kind, key, parent, length, accounted_bytes(length), cost, 1)
                self._index[(kind, key)] = e
                self._used += e.size

    def _load_frequencies(self) -> None:
        """Frequencies and GDSF's L saved at the last close (an older or damaged file only
        costs what it knew: items it does not name keep frequency 1)."""
        try:
            raw = (self._path / "index.bin").read_bytes()
        except OSError:
            return
        if len(raw) < _INDEX_HEAD.size:
            return
        magic, fmt, count, inflate, checksum = _INDEX_HEAD.unpack_from(raw)
        body = memoryview(raw)[_INDEX_HEAD.size :]
        ok = magic == _INDEX_MAGIC and fmt == FORMAT_VERSION and len(body) == count * _INDEX_REC.size
        if not ok or xxhash.xxh3_64_intdigest(body) != checksum:
            return
        self._inflate = inflate
        index = self._index
        for kind, key, freq in _INDEX_REC.iter_unpack(body):
            e = index.get((ItemKind(kind), int.from_bytes(key, "little")))
            if e is not None:
                e.freq = freq

    def _load_index(self) -> None:
        self._list_items()
        self._load_frequencies()
        for e in self._index.values():
            if e.parent:
                self._deps[e.parent] = self._deps.get(e.parent, 0) + 1
        for e in self._index.values():
            self._push(e)
        victims, _ = self._make_room(0)  # the capacity may have shrunk since the last run
        self._counters["evicted_items"] += len(victims)
        self._unlink_victims(victims)

    def _unlink_victims(self, victims: list[_Entry]) -> None:
        """Remove evicted items' files (lock not held); until then ``put`` refuses their keys,
        so a new copy cannot be written under a name that is about to be unlinked."""
        for v in victims:
            with contextlib.suppress(OSError):
                os.unlink(self._item_path(v))
        if victims:
            with self._lock:
                self._unlinking.difference_update((v.kind, v.key) for v in victims)

    # ------------------------------------------------------------------ eviction (lock held)
    def _exclusive_size(self, e: _Entry) -> int:
        """A checkpoint's bytes plus the KV path only it keeps useful."""
        total = e.size
        k = e.parent
        for _ in range(_MAX_CHAIN):
            kv = self._index.get((ItemKind.KV, k)) if k else None
            if kv is None or self._deps.get(k, 0) != 1:
                break
            total += kv.size
            k = kv.parent
        return total

    def _priority(self, e: _Entry) -> float:
        """GDSF: H = L + freq * cost / size; a KV block's value lives in its checkpoints."""
        if e.kind == ItemKind.KV or e.cost <= 0:
            return e.base
        return e.base + e.freq * e.cost / self._exclusive_size(e)

    def _is_leaf(self, e: _Entry) -> bool:
        return e.kind == ItemKind.CHECKPOINT or self._deps.get(e.key, 0) == 0

    def _push(self, e: _Entry) -> None:
        """(Re)insert ``e`` in the heap if it is a leaf; older heap entries become stale."""
        e.gen += 1
        if not self._is_leaf(e):
            return
        e.base = self._inflate
        e.h = self._priority(e)
        self._seq += 1
        heapq.heappush(self._heap, (e.h, self._seq, e.gen, int(e.kind), e.key))
        if len(self._heap) > 2 * len(self._index) + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale heap entries (reads re-push items, each leaving one behind)."""
        live = []
        for h, seq, gen, kind, key in self._heap:
            e = self._index.get((ItemKind(kind), key))
            if e is not None and e.gen == gen:
                live.append((h, seq, gen, kind, key))
        heapq.heapify(live)
        self._heap = live

    def _drop_dependent(self, parent: int) -> None:
        """One dependent of ``parent`` is gone; the KV block there may now be a leaf."""
        if not parent:
            return
        left = self._deps.get(parent, 0) - 1
        if left > 0:
            self._deps[parent] = left
            return
        self._deps.pop(parent, None)
        kv = self._index.get((ItemKind.KV, parent))
        if kv is not None:
            self._push(kv)

    def _remove(self, e: _Entry) -> None:
        del self._index[(e.kind, e.key)]
        self._used -= e.size
        e.gen += 1
        self._drop_dependent(e.parent)

    def _pop_victim(self) -> _Entry | None:
        while self._heap:
            h, _, gen, kind, key = heapq.heappop(self._heap)
            e = self._index.get((ItemKind(kind), key))
            if e is None or e.gen != gen or not self._is_leaf(e):
                continue
            if e.kind == ItemKind.CHECKPOINT and e.cost > 0:
                # lazily re-priced: a fork that appeared above it since it was pushed shortened
                # its exclusive path, so its value per byte rose
                now = e.base + e.freq * e.cost / self._exclusive_size(e)
                if now > h:
                    e.h = now
                    self._seq += 1
                    heapq.heappush(self._heap, (now, self._seq, e.gen, kind, key))
                    continue
            self._inflate = max(self._inflate, h)
            return e
        return None

    # ------------------------------------------------------------------ public API
    @property
    def path(self) -> Path:
        return self._path

    def has(self, kind: ItemKind, key: int) -> bool:
        """Written and indexed (a later ``read`` may still miss if the file was damaged)."""
        with self._lock:
            return (kind, key) in self._index

    def items(self) -> list[tuple[ItemKind, int]]:
        """Every (kind, key) written and indexed, in no particular order (a snapshot)."""
        with self._lock:
            return list(self._index)

    def queued(self, kind: ItemKind, key: int) -> bool:
        """Accepted by ``put``, not yet written."""
        with self._lock:
            return (kind, key) in self._queued

    def put(
        self,
        kind: ItemKind,
        key: int,
        parent: int,
        payload: bytes | bytearray | memoryview,
        cost: float,
    ) -> bool:
        """Queue an item for the writer; False (a counted drop) if it cannot be taken now.

        Never waits on disk. ``bytes`` are kept as they are; a ``bytearray`` or
        ``memoryview`` is copied (the caller may reuse its buffer).
        """
        if not isinstance(kind, ItemKind):
            raise ValueError(f"kind must be an ItemKind, got {kind!r}")
        if not (0 <= key < _KEY_LIMIT and 0 <= parent < _KEY_LIMIT):
            raise ValueError(f"key and parent must be 128-bit unsigned ints, got {key}, {parent}")
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"cost must be finite and >= 0, got {cost}")
        ident = (kind, key)
        nbytes = memoryview(payload).nbytes
        with self._lock:
            if self._refuses(ident, nbytes):  # before any copy: a drop must stay cheap
                return False
        data = payload if isinstance(payload, bytes) else bytes(payload)
        with self._lock:
            if self._refuses(ident, nbytes):
                return False
            self._queue.append(_Pending(kind, key, parent, data, float(cost)))
            self._queued.add(ident)
            self._queued_bytes += len(data)
            if parent:
                self._deps[parent] = self._deps.get(parent, 0) + 1
            self._cond.notify_all()
        return True

    def _refuses(self, ident: tuple[ItemKind, int], nbytes: int) -> bool:
        """Whether ``put`` must drop this item now (counted). Lock held."""
        refuse = (
            self._closed
            or ident in self._index
            or ident in self._queued
            or ident in self._unlinking
            or len(self._queue) >= self._queue_items
            or self._queued_bytes + nbytes > self._queue_bytes
            or accounted_bytes(nbytes) > self._capacity
        )
        if refuse:
            self._counters["queue_drops"] += 1
        return refuse

    def read(self, kind: ItemKind, key: int) -> bytes | None:
        """The verified payload, or None (missing or damaged: counted and forgotten; or the
        store is closed)."""
        with self._lock:
            e = None if self._closed else self._index.get((kind, key))
        if e is None:
            return None
        path = self._item_path(e)
        payload = None
        try:
            with open(path, "rb") as f:
                head = decode_header(f.read(HEADER_BYTES))
                if os.fstat(f.fileno()).st_size == HEADER_BYTES + e.length:
                    payload = f.read(e.length)
        except OSError:
            head = None
        ok = (
            head is not None
            and payload is not None
            and head[:4] == (kind, key, e.parent, e.length)
            and len(payload) == e.length
            and xxhash.xxh3_64_intdigest(payload) == head[5]
        )
        with self._lock:
            current = self._index.get((kind, key)) is e
            if not ok:
                if current:  # damaged; an item evicted meanwhile is just a miss
                    self._counters["damaged_items"] += 1
                    self._remove(e)
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    log.warning("disk_store.damaged_item", kind=e.kind.name, key=f"{key:032x}")
                return None
            self._counters["items_read"] += 1
            self._counters["bytes_read"] += e.length
            if current:
                e.freq += 1
                self._push(e)
        return payload

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written (or dropped); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Write what is queued, stop the writer, save the index, release the lock."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for t in self._writers:
            t.join()
        try:
            self._save_index()
        except OSError as e:
            log.warning("disk_store.index_save_failed", path=str(self._path), error=str(e))
        os.close(self._lock_fd)
        log.info("disk_store.closed", path=str(self._path), items=len(self._index))

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = {
                "disk.items": len(self._index),
                "disk.bytes": self._used,
                "disk.capacity_bytes": self._capacity,
                "disk.queue_items": len(self._queue),
                "disk.queue_bytes": self._queued_bytes,
            }
            out.update({f"disk.{k}": v for k, v in self._counters.items()})
        return out

    def describe(self) -> dict[str, object]:
        with self._lock:
            return {
                "path": str(self._path),
                "items": len(self._index),
                "bytes": self._used,
                "capacity": self._capacity,
                "age_s": round(time.time() - self._created, 1),
                "opened_in_ms": round(self._opened_in_ms, 1),
                "set_aside": None if self._set_aside is None else str(self._set_aside),
            }

    # ------------------------------------------------------------------ writer thread
    def _run_writer(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # closed and drained
                    self._cond.notify_all()
                    return
                item = self._queue.popleft()
                self._writing += 1
            try:
                self._write(item)
            except Exception:  # a bug must not stop the writer (flush would wait forever)
                log.exception("disk_store.writer_failed", path=str(self._path))
                with self._lock:
                    self._counters["write_errors"] += 1
            finally:
                with self._cond:
                    self._writing -= 1
                    self._queued.discard((item.kind, item.key))
                    self._queued_bytes -= len(item.payload)
                    self._cond.notify_all()

    def _make_room(self, size: int) -> tuple[list[_Entry], bool]:
        """Victims evicted (removed from the index) so ``size`` more bytes fit, and whether
        they do fit: an item whose dependent is still queued cannot go. Lock held."""
        victims: list[_Entry] = []
        while self._used + size > self._capacity:
            v = self._pop_victim()
            if v is None:
                return victims, False
            self._remove(v)
            self._unlinking.add((v.kind, v.key))
            victims.append(v)
        return victims, True

    def _write(self, item: _Pending) -> None:
        size = accounted_bytes(len(item.payload))
        with self._lock:
            victims, fits = self._make_room(size)
            self._counters["evicted_items"] += len(victims)
            if fits:
                self._used += size  # reserved while the file is written
            else:
                self._counters["queue_drops"] += 1
                self._drop_dependent(item.parent)
        self._unlink_victims(victims)
        if not fits:
            return
        header = encode_header(item.kind, item.key, item.parent, item.payload, item.cost)
        final = self._item_path(item)
        tmp = os.path.join(self._tmp_dir, os.path.basename(final))
        try:
            fan = item.key >> (128 - _FANOUT_BITS)
            if fan not in self._fan_dirs:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                self._fan_dirs.add(fan)
            _write_file(tmp, header, item.payload)
            os.rename(tmp, final)
        except Exception as e:  # an I/O error above all; anything else must not leak bytes
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with self._lock:
                self._used -= size
                self._counters["write_errors"] += 1
                self._drop_dependent(item.parent)
            self._log_write_error(e)
            return
        with self._lock:
            e = _Entry(item.kind, item.key, item.parent, len(item.payload), size, item.cost, 1)
            self._index[(item.kind, item.key)] = e
            self._push(e)
            self._counters["items_written"] += 1
            self._counters["bytes_written"] += len(item.payload)

    def _log_write_error(self, e: Exception) -> None:
        """Once per error kind per interval: a full disk would otherwise log every item."""
        code = e.errno if isinstance(e, OSError) else None
        kind = errno.errorcode.get(code or 0, type(e).__name__)
        now = time.monotonic()
        last = self._error_log_at.get(kind)
        if last is not None and now - last < _ERROR_LOG_INTERVAL_S:
            return
        self._error_log_at[kind] = now
        log.warning(
            "disk_store.write_error",
            path=str(self._path),
            error=kind,
            detail=str(e),
            write_errors=self._counters["write_errors"],
        )

    def _save_index(self) -> None:
        with self._lock:
            entries = list(self._index.values())
            inflate = self._inflate
        body = b"".join(
            _INDEX_REC.pack(int(e.kind), e.key.to_bytes(16, "little"), e.freq) for e in entries if e.freq > 1
        )
        count = len(body) // _INDEX_REC.size
        head = _INDEX_HEAD.pack(_INDEX_MAGIC, FORMAT_VERSION, count, inflate, xxhash.xxh3_64_intdigest(body))
        _fsync_replace(self._path / "index.bin", head + body)
