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
  filesystem blocks). Eviction is ``cache/disk_index.py``'s GreedyDual-Size-Frequency over
  *leaves* only: an item that another stored or queued item depends on (its ``parent``)
  stays until its dependents go.
* One process at a time: ``flock`` on ``<path>/lock``; a second opener gets ``DiskStoreLocked``.
* The store owns only what it made (``cache/disk_layout.py``): a missing or empty path
  becomes a store; a store (``manifest.json``, the marker) is reused if its ``StoreIdentity``
  equals the caller's, else its own entries go to ``<path>/set-aside-<utc stamp>/`` (marked;
  older marked ones are removed) and a warning names the fields that differ; a non-empty
  folder that is not a store is refused untouched (``DiskStoreError``).
* No link inside the store is followed (folder descriptors, ``O_NOFOLLOW``); an item is read
  only from a regular file (``O_NONBLOCK``: a FIFO is a miss, never a wait).
* ``close`` never waits for a read: a read still running then returns None, and the folder
  descriptors stay open until the last such read ends.

Layout (``cache/disk_format.py``: the header, the names, ``index.bin``): ``manifest.json``;
``items/<first byte of key>/<name>``, one file per item, its name all the index needs (an
open lists directories, opens no item); ``tmp/`` (writes in progress, emptied at open);
``index.bin`` (frequencies and GDSF's L saved at close; lost in a crash: frequency 1).

Why files and not segments (measured with ``tools/bench/bench_disk_store.py``; docs/cache.md, "The
disk tier"): a full cache evicts by value, not by age, so segments must compact to reclaim
space (1.6 records copied per record written with 20 % of the disk dead, 3.9 with 10 %);
a file is freed by an unlink, so the whole capacity is usable. Two writer threads overlap
the file-creation waits (10 GB of 0.8B-shaped items: 28.7 s, segments 33.0 s). The weak
spot is tiny items (16 KiB: tens of MB/s, an open of ~18 us per item).

fsync policy: none per item. A crash of the process cannot tear a renamed file (its writes
are in the page cache before the rename); a power loss can, and then the payload checksum
fails and the item is a miss. Durability of the last items across a power loss is not
promised. ``manifest.json`` and ``index.bin`` are fsynced before their rename (rare writes).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import msgspec
import xxhash

from deltaserve.cache.disk_format import (
    FORMAT_VERSION,
    FS_BLOCK,
    HEADER_BYTES,
    KEY_LIMIT,
    ItemKind,
    Manifest,
    StoreIdentity,
    accounted_bytes,
    decode_header,
    decode_index,
    encode_header,
    encode_index,
    fan_of,
    item_name,
    parse_item_name,
)
from deltaserve.cache.disk_index import DiskEntry, DiskIndex
from deltaserve.cache.disk_layout import (
    INDEX,
    ITEMS,
    LOCK,
    MANIFEST,
    READ_FLAGS,
    TMP,
    DiskStoreError,
    DiskStoreLocked,
    Survey,
    clear_tmp,
    create_file,
    encode_manifest,
    list_items,
    open_dir,
    own_dir,
    read_regular,
    refuse_foreign,
    remove_older_set_asides,
    replace_file,
    set_aside,
    survey,
    take_lock,
    unlink_in,
)
from deltaserve.logs import get_logger

# the format's names and the errors are imported from here too
__all__ = ["FORMAT_VERSION", "HEADER_BYTES", "DiskStore", "DiskStoreError", "DiskStoreLocked", "ItemKind",
           "StoreIdentity", "accounted_bytes", "item_name", "parse_item_name"]  # fmt: skip
log = get_logger("deltaserve.cache")

_ERROR_LOG_INTERVAL_S = 60.0
# Writer threads: creating a file costs this filesystem 0.3 ms idle and several ms under
# writeback pressure, mostly waiting (GIL released); two writers overlap those waits.
WRITER_THREADS = 2


@dataclass(slots=True)
class _Pending:
    kind: ItemKind
    key: int
    parent: int
    payload: bytes
    cost: float


def _length(e: DiskEntry | _Pending) -> int:
    return e.length if isinstance(e, DiskEntry) else len(e.payload)


def _write_file(fd: int, header: bytes, payload: bytes) -> None:
    """Write ``header + payload`` to a new file (the writer thread's only payload I/O)."""
    total = len(header) + len(payload)
    done = os.writev(fd, [header, payload])
    if done < total:  # a short write (rare, very large payloads): finish the rest
        rest = memoryview(header + payload)[done:]
        while rest:
            rest = rest[os.write(fd, rest) :]


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
        self._capacity = capacity_bytes
        self._identity = identity
        self._queue_items = queue_items
        self._queue_bytes = queue_bytes
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # entries, dependents and the eviction order; a queued item's parent is registered
        # at ``put`` (``depend``) so that a chain is not evicted from under a checkpoint that
        # is still on its way to disk
        self._index = DiskIndex(capacity_bytes)
        self._queue: deque[_Pending] = deque()
        self._queued: set[tuple[ItemKind, int]] = set()
        self._queued_bytes = 0
        self._writing = 0  # items the writers hold between queue and index
        self._unlinking: set[tuple[ItemKind, int]] = set()  # evicted, file not yet gone
        self._closed = False
        # reads between their index look-up and their end: the folder descriptors stay open
        # for them after ``close`` (released by the last one once ``_dirs_unused``)
        self._reads = 0
        self._dirs_unused = False
        self._counters = dict.fromkeys(
            ("bytes_written", "bytes_read", "items_written", "items_read", "queue_drops",
             "write_errors", "damaged_items", "evicted_items"), 0)  # fmt: skip
        self._error_log_at: dict[str, float] = {}
        self._set_aside: Path | None = None
        self._root = self._items_fd = self._tmp_fd = self._lock_fd = -1
        try:
            self._path.mkdir(parents=True, exist_ok=True)
            # the path itself may be a link (the user's choice); nothing inside it is followed
            self._root = os.open(self._path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise DiskStoreError(f"cannot create disk store {self._path}: {e}") from e
        try:
            refuse_foreign(survey(self._root), self._path)  # before anything is created there
            self._lock_fd, made_lock = take_lock(self._root, self._path)
            found = survey(self._root)  # again, under the lock: another opener may have been first
            if found.kind == "foreign" and made_lock:
                with contextlib.suppress(OSError):
                    os.unlink(LOCK, dir_fd=self._root)
            refuse_foreign(found, self._path)
            self._created = self._open_manifest(found)
            self._items_fd = own_dir(self._root, ITEMS)  # its fan-out folders come on demand
            self._tmp_fd = own_dir(self._root, TMP)
            clear_tmp(self._tmp_fd, self._path)
            self._load_index()
        except BaseException as e:
            self._close_dirs()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
            if isinstance(e, OSError):
                raise DiskStoreError(f"cannot open disk store {self._path}: {e}") from e
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
            bytes=self._index.used,
            capacity=self._capacity,
            opened_in_ms=round(self._opened_in_ms, 1),
        )

    # ------------------------------------------------------------------ open
    def _open_manifest(self, found: Survey) -> float:
        """The store's creation time; sets another identity's (or an unreadable) store aside
        first. The manifest is written before anything else of a new store: the marker."""
        old = found.manifest
        if found.kind == "store" and old is not None and old.identity == self._identity:
            if found.legacy:  # written by an earlier version: add the marker
                replace_file(self._root, MANIFEST, encode_manifest(old))
            return old.created
        if found.kind == "store":
            self._set_aside_store(
                old, "identity differs" if old is not None else f"manifest.json {found.reason}"
            )
        manifest = Manifest(identity=self._identity, created=time.time())
        replace_file(self._root, MANIFEST, encode_manifest(manifest))
        return manifest.created

    def _set_aside_store(self, old: Manifest | None, reason: str) -> None:
        name = set_aside(self._root, reason)
        self._set_aside = self._path / name
        remove_older_set_asides(self._root, self._path, name)
        differs: dict[str, object] = {}
        if old is not None:
            mine = msgspec.structs.asdict(self._identity)
            theirs = msgspec.structs.asdict(old.identity)
            differs = {k: {"store": theirs[k], "ours": v} for k, v in mine.items() if theirs[k] != v}
        log.warning(
            "disk_store.set_aside",
            path=str(self._path),
            set_aside=str(self._set_aside),
            reason=reason,
            differs=differs,
        )

    def _load_index(self) -> None:
        """Index what is on disk, with the frequencies and L saved at the last close (an
        older or damaged ``index.bin`` only costs what it knew: items restart at frequency 1)."""
        entries = list_items(self._items_fd)
        limit = 32 * max(self._capacity // FS_BLOCK, len(entries)) + 4096  # above any valid index
        raw, _ = read_regular(self._root, INDEX, limit)
        saved = decode_index(raw) if raw is not None else None
        inflation, freqs = saved if saved is not None else (0.0, {})
        for e in entries:
            e.freq = freqs.get((e.kind, e.key), e.freq)
        self._index.load(entries, inflation)
        victims, _ = self._index.make_room(0)  # the capacity may have shrunk since the last run
        self._counters["evicted_items"] += len(victims)
        self._unlink_victims(victims)

    def _close_dirs(self) -> None:
        for name in ("_items_fd", "_tmp_fd", "_root"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    @staticmethod
    def _names(e: DiskEntry | _Pending) -> tuple[str, str]:
        """(``items/`` fan folder, file name) of an item."""
        return f"{fan_of(e.key):02x}", item_name(e.kind, e.key, e.parent, _length(e), e.cost)

    def _unlink_victims(self, victims: list[DiskEntry]) -> None:
        """Remove evicted items' files (lock not held); until then ``put`` refuses their keys,
        so a new copy cannot be written under a name that is about to be unlinked."""
        for v in victims:
            unlink_in(self._items_fd, *self._names(v))
        if victims:
            with self._lock:
                self._unlinking.difference_update((v.kind, v.key) for v in victims)

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
        if not (0 <= key < KEY_LIMIT and 0 <= parent < KEY_LIMIT):
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
            self._index.depend(parent)
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
        """The verified payload, or None (missing or damaged: counted and forgotten; not a
        regular file; or the store is closed, also while the read ran)."""
        with self._lock:
            e = None if self._closed else self._index.get(kind, key)
            if e is None:
                return None
            self._reads += 1
        try:
            payload = self._read_file(e)
        finally:
            with self._lock:
                self._reads -= 1
                closed = self._closed
                if closed and self._dirs_unused and self._reads == 0:
                    self._close_dirs()
        if closed:  # the lock may be someone else's now: touch nothing
            return None
        with self._lock:
            current = self._index.get(kind, key) is e
            if payload is None:
                if current and not self._closed:  # damaged; one evicted meanwhile is just a miss
                    self._counters["damaged_items"] += 1
                    self._index.remove(e)
                    unlink_in(self._items_fd, *self._names(e))
                    log.warning("disk_store.damaged_item", kind=e.kind.name, key=f"{key:032x}")
                return None
            self._counters["items_read"] += 1
            self._counters["bytes_read"] += e.length
            if current:
                self._index.touch(e)
        return payload

    def _read_file(self, e: DiskEntry) -> bytes | None:
        """``e``'s payload if its file is a regular file that verifies, else None. Opened
        without following a link and without blocking (a FIFO is not waited on)."""
        fan, name = self._names(e)
        try:
            fan_fd = open_dir(self._items_fd, fan)
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=fan_fd)
            finally:
                os.close(fan_fd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size != HEADER_BYTES + e.length:
                    return None
                f = os.fdopen(fd, "rb")
            except BaseException:
                os.close(fd)
                raise
            with f:
                head = decode_header(f.read(HEADER_BYTES))
                payload = f.read(e.length)
        except OSError:
            return None
        ok = (
            head is not None
            and head[:4] == (e.kind, e.key, e.parent, e.length)
            and len(payload) == e.length
            and xxhash.xxh3_64_intdigest(payload) == head[5]
        )
        return payload if ok else None

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
        """Write what is queued, stop the writers, save the index, release the lock. Never
        waits for a read (a read still running returns None)."""
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
        with self._lock:
            self._dirs_unused = True
            if self._reads == 0:
                self._close_dirs()
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
                "disk.bytes": self._index.used,
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
                "bytes": self._index.used,
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

    def _make_room(self, size: int) -> tuple[list[DiskEntry], bool]:
        """Victims evicted (removed from the index) so ``size`` more bytes fit, and whether
        they do fit: an item whose dependent is still queued cannot go. Lock held."""
        victims, fits = self._index.make_room(size)
        self._unlinking.update((v.kind, v.key) for v in victims)
        return victims, fits

    def _write(self, item: _Pending) -> None:
        size = accounted_bytes(len(item.payload))
        with self._lock:
            victims, fits = self._make_room(size)
            self._counters["evicted_items"] += len(victims)
            if fits:
                self._index.reserve(size)  # while the file is written
            else:
                self._counters["queue_drops"] += 1
                self._index.undepend(item.parent)
        self._unlink_victims(victims)
        if not fits:
            return
        header = encode_header(item.kind, item.key, item.parent, item.payload, item.cost)
        fan, name = self._names(item)
        fan_fd = fd = -1
        try:
            fan_fd = own_dir(self._items_fd, fan)
            fd = create_file(self._tmp_fd, name)
            try:
                _write_file(fd, header, item.payload)
            finally:
                os.close(fd)
            os.rename(name, name, src_dir_fd=self._tmp_fd, dst_dir_fd=fan_fd)
        except Exception as e:  # an I/O error above all; anything else must not leak bytes
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._tmp_fd)
            with self._lock:
                self._index.release(size)
                self._counters["write_errors"] += 1
                self._index.undepend(item.parent)
            self._log_write_error(e)
            return
        finally:
            if fan_fd >= 0:
                os.close(fan_fd)
        with self._lock:
            self._index.release(size)
            self._index.add(DiskEntry(item.kind, item.key, item.parent, len(item.payload), size, item.cost))
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
            freqs = [(e.kind, e.key, e.freq) for e in self._index.entries()]
            inflation = self._index.inflation
        replace_file(self._root, INDEX, encode_index(freqs, inflation))
