"""RemoteStore: the remote tier's items in a Mooncake Store, published a whole path at a time.

Every object lives under the namespace of the cache identity (``StoreIdentity`` of
``cache/disk_format.py``, the disk tier's: model, weights, dtype, block size, GDN chunk,
salt rule, item sizes), so engines of another model or format never see each other's items.
Keys are the chained block hashes (``cache/hashing.py``): a key names its whole prefix.

Objects (``<ns>`` = ``deltaserve/<xxh3-128 of the identity>``):

* ``<ns>/kv/<key>-<sum>`` and ``<ns>/ck/<key>-<sum>``: one KV block or one checkpoint, as the
  disk store's item (checksummed header + payload; ``<sum>`` is the xxh3-64 of the whole
  object), so a name is its content: written once, never changed, never half-replaced;
* ``<ns>/path/<key>``: the *path manifest* of the checkpoint at ``key``: the object sums of
  the checkpoint and of every KV block from the root to it, with its own checksum.

**Atomic publication.** A checkpoint's manifest is written last, after its checkpoint and
every KV object its path names were written (by this store, in order, on its writer thread)
or read and verified; a path whose KV this store cannot name is not published
(``remote.publish_incomplete``). Readers look up manifests only: a payload without its
manifest (a torn write, a writer or master killed mid-write) is never read, and a hit is
read whole (every KV object after the reader's tree hit and the checkpoint, each verified
against the manifest's sums and its own header) or not at all: never half a hybrid hit.

**Local knowledge.** ``has``/``queued`` answer from memory (never a network call: the step
thread asks them): what this store wrote or verified (at most ``known_items`` of each kind,
least recently used forgotten). The store may evict; a stale ``has`` costs a write-through
it skips, never a wrong read (reads verify). ``items`` lists that knowledge, and
``watch(on_change)`` (the cache events, ``cache/event_collector.py``) reports it, then each item
gained or forgotten, from the writer or a reader thread, under the lock.

All network I/O runs on the client's I/O thread (``cache/remote_client.py``); ``put`` queues
for this store's writer thread (bounded: a full queue drops, counted); a store that is down
drops writes and misses reads. Torch-free.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import msgspec
import xxhash

from deltaserve.cache.disk_format import StoreIdentity, decode_header, encode_header
from deltaserve.cache.remote_client import MooncakeClient, RemoteUnavailable
from deltaserve.cache.types import DiskItemKind
from deltaserve.logs import get_logger

log = get_logger("deltaserve.cache")

KV, CHECKPOINT = DiskItemKind.KV, DiskItemKind.CHECKPOINT
MANIFEST_MAGIC = "deltaserve-path-1"


class PathManifest(msgspec.Struct, array_like=True, frozen=True):
    magic: str
    key: bytes  # the checkpoint's block hash, 16 bytes little-endian (the last of ``kv``)
    checkpoint: int  # xxh3-64 of the checkpoint object
    kv: list[tuple[bytes, int]]  # (block hash, xxh3-64 of its KV object), root first


def _b(key: int) -> bytes:
    return key.to_bytes(16, "little")


def _i(raw: bytes) -> int:
    return int.from_bytes(raw, "little")


def namespace(identity: StoreIdentity) -> str:
    return "deltaserve/" + xxhash.xxh3_128_hexdigest(msgspec.json.encode(identity))


def encode_manifest(m: PathManifest) -> bytes:
    body = msgspec.msgpack.encode(m)
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


def decode_manifest(raw: bytes) -> PathManifest | None:
    if len(raw) < 9:
        return None
    body, tail = raw[:-8], raw[-8:]
    if xxhash.xxh3_64_intdigest(body) != int.from_bytes(tail, "little"):
        return None
    try:
        m = msgspec.msgpack.decode(body, type=PathManifest)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return m if m.magic == MANIFEST_MAGIC and m.kv and m.kv[-1][0] == m.key else None


def verify_object(raw: bytes, kind: DiskItemKind, key: int, expect_sum: int, length: int) -> bytes | None:
    """The payload of an object named by ``expect_sum``, or None if it is not that object."""
    if xxhash.xxh3_64_intdigest(raw) != expect_sum:
        return None
    head = decode_header(raw)
    if head is None:
        return None
    k, got_key, _, n, _, psum = head
    payload = raw[len(raw) - n :] if n <= len(raw) else b""
    if int(k) != int(kind) or got_key != key or n != length or xxhash.xxh3_64_intdigest(payload) != psum:
        return None
    return payload


def _ok(rc: object) -> bool:
    return rc == 0


class RemoteStore:
    """The remote tier's store (module docstring); a ``Store`` of ``cache/disk_tier.py``
    for writes and ``has``/``queued``, with ``lookup``/``read_path`` for reads."""

    def __init__(
        self,
        client: MooncakeClient,
        identity: StoreIdentity,
        *,
        queue_bytes: int = 256 << 20,
        known_items: int = 1 << 17,  # (~150 bytes each)
    ) -> None:
        self.client, self.identity = client, identity
        self.ns = namespace(identity)
        self.queue_bytes, self.known_items = queue_bytes, known_items
        self._cond = threading.Condition()
        self._kv: OrderedDict[int, tuple[int, int]] = OrderedDict()  # key -> (parent, object sum)
        self._ckpt: OrderedDict[int, None] = OrderedDict()  # checkpoints published or verified
        self._queue: deque[tuple[DiskItemKind, int, int, bytes]] = deque()
        self._queued: set[tuple[DiskItemKind, int]] = set()
        self._queued_bytes = 0
        self._closed = False
        self.on_change: Callable[[int, int, int, bool], None] | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            ("remote.puts", "remote.put_failed", "remote.put_dropped", "remote.published",
             "remote.publish_incomplete", "remote.reads", "remote.read_damaged", "remote.read_missing",
             "remote.hits", "remote.bytes_written", "remote.bytes_read"), 0
        )  # fmt: skip
        self._writer = threading.Thread(target=self._write_loop, name="deltaserve-remote-write", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ names
    def _obj(self, kind: DiskItemKind, key: int, osum: int) -> str:
        return f"{self.ns}/{'kv' if kind is KV else 'ck'}/{key:032x}-{osum:016x}"

    def _manifest(self, key: int) -> str:
        return f"{self.ns}/path/{key:032x}"

    # ------------------------------------------------------------------ local knowledge
    def has(self, kind: DiskItemKind, key: int) -> bool:
        with self._cond:
            return key in (self._kv if kind is KV else self._ckpt)

    def queued(self, kind: DiskItemKind, key: int) -> bool:
        with self._cond:
            return (kind, key) in self._queued

    def items(self) -> list[tuple[DiskItemKind, int]]:
        """What this store knows the shared store holds (``has``), as (kind, key)."""
        with self._cond:
            return [(KV, k) for k in self._kv] + [(CHECKPOINT, k) for k in self._ckpt]

    def watch(self, on_change: Callable[[int, int, int, bool], None] | None) -> None:
        """Tell ``on_change`` of every item known now, then of each item gained or forgotten
        (None: stop); under the lock, so no change falls between the two."""
        with self._cond:
            if on_change is not None:
                for key, (parent, _) in self._kv.items():
                    on_change(int(KV), key, parent, True)
                for key in self._ckpt:
                    on_change(int(CHECKPOINT), key, 0, True)
            self.on_change = on_change

    def _changed(self, kind: DiskItemKind, key: int, parent: int, present: bool) -> None:
        if self.on_change is not None:
            self.on_change(int(kind), key, parent, present)

    def _know_kv(self, key: int, parent: int, osum: int) -> None:
        new = key not in self._kv
        self._kv[key] = (parent, osum)
        self._kv.move_to_end(key)
        if new:
            self._changed(KV, key, parent, True)
        if len(self._kv) > self.known_items:
            old, (old_parent, _) = self._kv.popitem(last=False)
            self._changed(KV, old, old_parent, False)

    def _know_ckpt(self, key: int) -> None:
        new = key not in self._ckpt
        self._ckpt[key] = None
        self._ckpt.move_to_end(key)
        if new:
            self._changed(CHECKPOINT, key, 0, True)
        if len(self._ckpt) > self.known_items:
            old, _ = self._ckpt.popitem(last=False)
            self._changed(CHECKPOINT, old, 0, False)

    # ------------------------------------------------------------------ writes
    def put(
        self, kind: DiskItemKind, key: int, parent: int, payload: bytes | bytearray | memoryview, cost: float
    ) -> bool:
        """Queue an item for the writer (in order: a checkpoint after the KV of its path);
        False (``remote.put_dropped``) when the queue is full or the store is unavailable."""
        kind = DiskItemKind(int(kind))
        data = bytes(payload)
        obj = encode_header(kind, key, parent, data, cost) + data  # (ItemKind and DiskItemKind agree)
        with self._cond:
            if self._closed or not self.client.available or self._queued_bytes + len(obj) > self.queue_bytes:
                self.counters["remote.put_dropped"] += 1
                return False
            self._queue.append((kind, key, parent, obj))
            self._queued.add((kind, key))
            self._queued_bytes += len(obj)
            self._cond.notify()
        return True

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                kind, key, parent, obj = self._queue[0]
            try:
                self._write(kind, key, parent, obj)
            except RemoteUnavailable:
                with self._cond:
                    self.counters["remote.put_failed"] += 1
            except Exception as e:  # a bug must not end the writer (its queue would never drain)
                log.error("remote.write_failed", error=repr(e))
                with self._cond:
                    self.counters["remote.put_failed"] += 1
            finally:
                with self._cond:
                    self._queue.popleft()
                    self._queued.discard((kind, key))
                    self._queued_bytes -= len(obj)
                    self._cond.notify_all()

    def _write(self, kind: DiskItemKind, key: int, parent: int, obj: bytes) -> None:
        osum = xxhash.xxh3_64_intdigest(obj)
        if kind is KV:
            self.client.call("put", self._obj(KV, key, osum), obj, ok=_ok)
            with self._cond:
                self.counters["remote.puts"] += 1
                self.counters["remote.bytes_written"] += len(obj)
                self._know_kv(key, parent, osum)
            return
        path = self._path_of(key)
        if path is None:  # a block of its path is neither written nor verified here
            with self._cond:
                self.counters["remote.publish_incomplete"] += 1
            return
        self.client.call("put", self._obj(CHECKPOINT, key, osum), obj, ok=_ok)
        manifest = encode_manifest(PathManifest(MANIFEST_MAGIC, _b(key), osum, [(_b(k), s) for k, s in path]))
        # last: the path becomes readable with it (a later one of the same path replaces it)
        self.client.call("upsert", self._manifest(key), manifest, ok=_ok)
        with self._cond:
            self.counters["remote.puts"] += 1
            self.counters["remote.published"] += 1
            self.counters["remote.bytes_written"] += len(obj) + len(manifest)
            self._know_ckpt(key)

    def _path_of(self, key: int) -> list[tuple[int, int]] | None:
        """(key, object sum) of every KV block from the root to ``key``, or None."""
        path: list[tuple[int, int]] = []
        with self._cond:
            k = key
            while k != 0:
                known = self._kv.get(k)
                if known is None or len(path) > 1 << 20:
                    return None
                path.append((k, known[1]))
                k = known[0]
        path.reverse()
        return path

    def flush(self, timeout_s: float) -> bool:
        """Wait until the writer has drained its queue (at most ``timeout_s``)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue, timeout=timeout_s)

    # ------------------------------------------------------------------ reads (reader threads)
    def lookup(self, keys: Sequence[int], boundaries: Sequence[int]) -> list[int]:
        """The boundaries (in blocks, as given: deepest first) whose path manifest is in the
        store now. ``RemoteUnavailable`` if the store cannot say."""
        names = [self._manifest(keys[b - 1]) for b in boundaries]
        found = self.client.call("batch_is_exist", names)
        return [b for b, there in zip(boundaries, found, strict=True) if there == 1]

    def read_path(
        self, keys: Sequence[int], start: int, end: int, kv_bytes: int, ckpt_bytes: int
    ) -> tuple[list[bytes], bytes] | None:
        """The KV payloads of blocks ``start .. end`` and the checkpoint at ``end``, each
        verified against the path manifest of ``keys[end - 1]`` (which must name exactly
        ``keys[:end]``); None if anything is missing or does not verify (counted).
        ``RemoteUnavailable`` if the store fails meanwhile."""
        raw = self.client.call("get", self._manifest(keys[end - 1]))
        self._count("remote.reads")
        m = decode_manifest(raw) if raw else None
        if (
            m is None
            or len(m.kv) != end
            or any(_i(k) != want for (k, _), want in zip(m.kv, keys[:end], strict=True))
        ):
            self._count("remote.read_missing" if not raw else "remote.read_damaged")
            return None
        wanted = [(_i(k), s) for k, s in m.kv[start:end]]
        ckey = _i(m.key)
        names = [self._obj(KV, k, s) for k, s in wanted] + [self._obj(CHECKPOINT, ckey, m.checkpoint)]
        objs = self.client.call("get_batch", names)
        if len(objs) != len(names):
            self._count("remote.read_damaged")
            return None
        kv: list[bytes] = []
        for (k, s), raw_kv in zip(wanted, objs, strict=False):
            payload = verify_object(raw_kv, KV, k, s, kv_bytes) if raw_kv else None
            if payload is None:
                self._count("remote.read_missing" if not raw_kv else "remote.read_damaged")
                return None
            kv.append(payload)
        state = verify_object(objs[-1], CHECKPOINT, ckey, m.checkpoint, ckpt_bytes) if objs[-1] else None
        if state is None:
            self._count("remote.read_missing" if not objs[-1] else "remote.read_damaged")
            return None
        with self._cond:  # verified: this store can name them in paths it publishes
            self.counters["remote.hits"] += 1
            self.counters["remote.bytes_read"] += len(raw) + sum(len(o) for o in objs)
            parent = 0
            for k, s in m.kv:
                self._know_kv(_i(k), parent, s)
                parent = _i(k)
            self._know_ckpt(ckey)
        return kv, state

    def read(self, kind: DiskItemKind, key: int) -> bytes | None:
        """Not a way in: remote items are read a whole path at a time (``read_path``)."""
        return None

    def _count(self, name: str) -> None:
        with self._cond:
            self.counters[name] += 1

    # ------------------------------------------------------------------ reporting, close
    def stats(self) -> dict[str, int | float]:
        with self._cond:
            out: dict[str, int | float] = dict(self.counters)
            out["remote.known_kv"] = len(self._kv)
            out["remote.known_checkpoints"] = len(self._ckpt)
            out["remote.queue_items"] = len(self._queue)
            out["remote.queue_bytes"] = self._queued_bytes
        out.update(self.client.counters)
        return out

    def describe(self) -> dict[str, object]:
        return {"url": self.client.url, "namespace": self.ns}

    def close(self, flush_s: float = 5.0) -> None:
        """Write what is queued (at most ``flush_s``; a store that is down drops it), stop
        the writer, close the client."""
        self.flush(flush_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout=flush_s)
        self.client.close()
