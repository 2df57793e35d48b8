"""Disk-store layouts measured on this machine: the numbers behind cache/disk_store.py's layout.

Candidates:

* ``files``: ``cache.disk_store.DiskStore`` itself (one file per item, tmp + rename, 256
  fan-out directories), driven through its public API (queue, writer thread, eviction).
* ``segments``: append-only segment files of ``--segment-mib`` with the same 72-byte record
  header, an in-memory index, reads by ``pread``; reopened by scanning the record headers
  (no eviction: it would need compaction, which is not built here).
* ``sqlite``: one stdlib sqlite3 table (WAL, ``synchronous=NORMAL``), payloads as blobs, a
  commit per item (what the store acknowledges survives a crash of the process).

Per item size (the tiny model's KV block and checkpoint, a Qwen3.5-0.8B shape's, a 4B
shape's) it writes ``--mib`` MiB and reads it back: write MB/s (until written, not queued),
read MB/s warm (page cache) and cold (pages dropped with ``posix_fadvise(DONTNEED)`` after a
sync: no root needed; directory and inode caches stay warm), in a shuffled order. Files per GB follow from the
layout. ``--open-gb``: a store of that many GB per candidate (0.8B-shaped mix: one 19 MiB
checkpoint per 32 KV blocks), closed, reopened and timed, then deleted; ``--open-small-gb``
the same with 16 KiB items only (the file count's worst case). ``--crash``: a child writes
in a loop and is SIGKILLed; the reopened store must verify every item it lists.

The candidates of one item size run as ``--rounds`` interleaved rounds (``harness.interleaved``);
the table shows each one's median round, ``--json`` every round.

    python tools/bench/bench_disk_store.py [--mib 256] [--open-gb 10] [--open-small-gb 10] [--crash]
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import xxhash

from deltaserve.cache import disk_store
from deltaserve.cache.disk_store import (
    HEADER_BYTES,
    DiskStore,
    ItemKind,
    StoreIdentity,
    decode_header,
    encode_header,
)
from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, interleaved, spread, timed

KiB, MiB = 1 << 10, 1 << 20
SIZES = [
    ("tiny KV", 16 * KiB),
    ("tiny ckpt", 200 * KiB),
    ("0.8B KV", 384 * KiB),
    ("0.8B ckpt", 19 * MiB),
    ("4B KV", 512 * KiB),
    ("4B ckpt", 50 * MiB),
]
IDENT = StoreIdentity(
    model="bench",
    weights="bench",
    dtype="bfloat16",
    block_size=16,
    gdn_chunk_size=64,
    salt_rule="bench",
    kv_block_bytes=384 * KiB,
    checkpoint_bytes=19 * MiB,
)
BIG_CAPACITY = 1 << 40


class Candidate(Protocol):
    def put(self, kind: ItemKind, key: int, parent: int, payload: bytes) -> None: ...
    def flush(self) -> None: ...
    def read(self, kind: ItemKind, key: int) -> bytes | None: ...
    def listed(self) -> list[tuple[ItemKind, int]]: ...
    def drop_cache(self) -> None: ...
    def close(self) -> None: ...


def _fadvise_dontneed(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class FilesCandidate:
    def __init__(self, path: Path) -> None:
        self.store = DiskStore(path, BIG_CAPACITY, IDENT, queue_items=256, queue_bytes=512 * MiB)

    def put(self, kind: ItemKind, key: int, parent: int, payload: bytes) -> None:
        while not self.store.put(kind, key, parent, payload, 1.0):
            self.store.flush(0.05)  # the queue is full: the bench wants every item written

    def flush(self) -> None:
        self.store.flush()

    def read(self, kind: ItemKind, key: int) -> bytes | None:
        return self.store.read(kind, key)

    def listed(self) -> list[tuple[ItemKind, int]]:
        return self.store.items()

    def drop_cache(self) -> None:
        os.sync()
        for root, _, names in os.walk(self.store.path / "items"):
            for n in names:
                _fadvise_dontneed(os.path.join(root, n))

    def close(self) -> None:
        self.store.close()


class SegmentsCandidate:
    """Append-only segments; a record is the disk store's header followed by the payload."""

    def __init__(self, path: Path, segment_bytes: int = 256 * MiB) -> None:
        self.dir = path
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.index: dict[tuple[ItemKind, int], tuple[int, int, int]] = {}  # seg, offset, len
        self.fds: dict[int, int] = {}
        self.seg = -1
        self.offset = 0
        for seg in sorted(int(p.stem) for p in self.dir.glob("*.seg")):
            self._scan(seg)
        self._next_segment()

    def _open(self, seg: int) -> int:
        if seg not in self.fds:
            self.fds[seg] = os.open(self.dir / f"{seg:08d}.seg", os.O_RDWR | os.O_CREAT, 0o644)
        return self.fds[seg]

    def _scan(self, seg: int) -> None:
        fd = self._open(seg)
        size = os.fstat(fd).st_size
        off = 0
        while off + HEADER_BYTES <= size:
            head = decode_header(os.pread(fd, HEADER_BYTES, off))
            if head is None or off + HEADER_BYTES + head[3] > size:
                break
            self.index[(head[0], head[1])] = (seg, off, head[3])
            off += HEADER_BYTES + head[3]
        if off < size:  # a torn tail record: cut it off
            os.ftruncate(fd, off)

    def _next_segment(self) -> None:
        self.seg = max([self.seg, *self.fds.keys()]) + 1
        self.offset = 0
        self._open(self.seg)

    def put(self, kind: ItemKind, key: int, parent: int, payload: bytes) -> None:
        if self.offset >= self.segment_bytes:
            self._next_segment()
        fd = self.fds[self.seg]
        header = encode_header(kind, key, parent, payload, 1.0)
        os.pwritev(fd, [header, payload], self.offset)
        self.index[(kind, key)] = (self.seg, self.offset, len(payload))
        self.offset += len(header) + len(payload)

    def flush(self) -> None:
        return None

    def read(self, kind: ItemKind, key: int) -> bytes | None:
        seg, off, length = self.index[(kind, key)]
        raw = os.pread(self.fds[seg], HEADER_BYTES + length, off)
        head = decode_header(raw[:HEADER_BYTES])
        payload = raw[HEADER_BYTES:]
        if head is None or xxhash.xxh3_64_intdigest(payload) != head[5]:
            return None
        return payload

    def listed(self) -> list[tuple[ItemKind, int]]:
        return list(self.index)

    def drop_cache(self) -> None:
        os.sync()
        for fd in self.fds.values():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class SqliteCandidate:
    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.file = path / "store.db"
        self.db = sqlite3.connect(self.file, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS items (kind INTEGER, key BLOB, parent BLOB, "
            "checksum INTEGER, data BLOB, PRIMARY KEY (kind, key))"
        )
        rows = self.db.execute("SELECT kind, key FROM items")
        self.index = {(ItemKind(k), int.from_bytes(key, "little")) for k, key in rows}

    def put(self, kind: ItemKind, key: int, parent: int, payload: bytes) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO items VALUES (?, ?, ?, ?, ?)",
            (
                int(kind),
                key.to_bytes(16, "little"),
                parent.to_bytes(16, "little"),
                xxhash.xxh3_64_intdigest(payload) >> 1,
                payload,
            ),
        )
        self.index.add((kind, key))

    def flush(self) -> None:
        return None

    def read(self, kind: ItemKind, key: int) -> bytes | None:
        row = self.db.execute(
            "SELECT checksum, data FROM items WHERE kind = ? AND key = ?",
            (int(kind), key.to_bytes(16, "little")),
        ).fetchone()
        if row is None or xxhash.xxh3_64_intdigest(row[1]) >> 1 != row[0]:
            return None
        return bytes(row[1])

    def listed(self) -> list[tuple[ItemKind, int]]:
        return list(self.index)

    def drop_cache(self) -> None:
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        os.sync()
        _fadvise_dontneed(str(self.file))

    def close(self) -> None:
        self.db.close()


def _files_with(writers: int) -> type[FilesCandidate]:
    class Files(FilesCandidate):
        def __init__(self, path: Path) -> None:
            saved = disk_store.WRITER_THREADS
            disk_store.WRITER_THREADS = writers
            try:
                super().__init__(path)
            finally:
                disk_store.WRITER_THREADS = saved

    return Files


CANDIDATES: dict[str, type[Candidate]] = {
    "files": FilesCandidate,
    "segments": SegmentsCandidate,
    "sqlite": SqliteCandidate,
}
FILES_PER_GB = {
    "files": lambda size: (1 << 30) / size,
    "segments": lambda size: (1 << 30) / (256 * MiB),
    "sqlite": lambda size: 2.0,  # the database and its WAL
}


def payload_of(key: int, size: int) -> bytes:
    return (key.to_bytes(8, "little") * (size // 8 + 1))[:size]


def throughput(name: str, root: Path, size: int, total: int) -> tuple[float, float, float]:
    """(write, warm read, cold read) MB/s for items of ``size`` bytes, ``total`` bytes."""
    count = max(4, total // size)
    payloads = [payload_of(k, size) for k in range(min(count, 8))]
    store = CANDIDATES[name](root / f"{name}-{size}")

    def write_all() -> None:
        for k in range(1, count + 1):
            store.put(ItemKind.KV, k, k - 1, payloads[k % len(payloads)])
        store.flush()

    def read_all() -> None:
        for k in order:
            assert store.read(ItemKind.KV, k) is not None

    write = count * size / timed(write_all)[0] / 1e6
    order = list(range(1, count + 1))
    random.Random(size).shuffle(order)  # hits come from anywhere: no free readahead
    rates = []
    for cold in (False, True):
        if cold:
            store.drop_cache()
        rates.append(count * size / timed(read_all)[0] / 1e6)
    store.close()
    shutil.rmtree(root / f"{name}-{size}")
    return write, rates[0], rates[1]


def mixed_items(total: int, kv: int, ckpt: int, every: int) -> Iterator[tuple[ItemKind, int, int, int]]:
    """(kind, key, parent, size) of chains of ``every`` KV blocks, a checkpoint at each end."""
    done, key = 0, 0
    while done < total:
        for i in range(every):
            key += 1
            yield ItemKind.KV, key, (key - 1) if i else 0, kv
            done += kv
        if ckpt:
            yield ItemKind.CHECKPOINT, key, key, ckpt
            done += ckpt


def open_time(name: str, root: Path, total: int, kv: int, ckpt: int) -> tuple[int, float, float]:
    """(items, seconds to write, seconds to reopen) for a store of ``total`` bytes."""
    path = root / f"open-{name}"
    cache: dict[int, bytes] = {}
    store = CANDIDATES[name](path)

    def write_all() -> int:
        for kind, key, parent, size in mixed_items(total, kv, ckpt, 32):
            data = cache.setdefault(size, payload_of(size, size))
            store.put(kind, key, parent, data)
        store.flush()
        listed = len(store.listed())
        store.close()
        return listed

    written, items = timed(write_all)
    reopened, store = timed(lambda: CANDIDATES[name](path))
    assert len(store.listed()) == items, (len(store.listed()), items)
    store.close()
    shutil.rmtree(path)
    return items, written, reopened


_CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {tools!r})
from bench_disk_store import CANDIDATES, ItemKind, payload_of
store = CANDIDATES[sys.argv[1]](Path(sys.argv[2]))
k = max((key for _, key in store.listed()), default=0)  # after an earlier kill: new keys
while True:
    k += 1
    store.put(ItemKind.KV, k, k - 1, payload_of(k, 1000 + (k * 7919) % (2 << 20)))
    if k % 20 == 0:
        print("WRITING", flush=True)
"""


def crash(name: str, root: Path, runs: int) -> tuple[int, int, int]:
    """(items listed after ``runs`` kill -9s, items that failed to verify, torn writes seen)."""
    path = root / f"crash-{name}"
    code = _CHILD.format(tools=str(Path(__file__).parent))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = "files" if name.startswith("files") else name  # the child's default writer count
    partial = 0  # files: writes cut by a kill (left in tmp/, removed by the next open)
    for _ in range(runs):
        child = subprocess.Popen(
            [sys.executable, "-c", code, base, str(path)], env=env, stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "WRITING"
        time.sleep(1.0)
        child.send_signal(signal.SIGKILL)
        child.wait()
        partial += len(list((path / "tmp").iterdir())) if (path / "tmp").is_dir() else 0
    store = CANDIDATES[name](path)
    listed = store.listed()
    bad = sum(
        store.read(kind, key) != payload_of(key, 1000 + (key * 7919) % (2 << 20)) for kind, key in listed
    )
    store.close()
    shutil.rmtree(path)
    return len(listed), bad, partial


def compaction_amplification(slack: float, segment_items: int = 64, segments: int = 64) -> float:
    """Records a segment layout copies per record written, at steady state, when a full store
    evicts by value (random victims: value is unrelated to age) and reclaims space by
    compacting the segment with the fewest live records. ``slack``: the fraction of the disk
    budget left to dead records (live records fill the rest). One file per item copies
    nothing (an eviction is an unlink) and has no slack.
    """
    rng = random.Random(0)
    live_cap = int(segments * segment_items * (1 - slack))
    live = [0] * segments  # live records per segment
    keys: list[tuple[int, int]] = []  # (key, segment) of every live record
    free = list(range(1, segments))
    head, fill, copied = 0, 0, 0
    steps = segments * segment_items * 30
    for step in range(steps):
        if len(keys) >= live_cap:  # evict a random live record: it goes dead in place
            i = rng.randrange(len(keys))
            live[keys[i][1]] -= 1
            keys[i] = keys[-1]
            keys.pop()
        if fill == segment_items:
            if free:
                head, fill = free.pop(), 0
            else:  # compact the emptiest segment: its live records are copied, it is the head
                head = min((i for i in range(segments) if i != head), key=live.__getitem__)
                fill = live[head]
                copied += fill if step > steps // 3 else 0  # count at steady state only
        keys.append((step, head))
        live[head] += 1
        fill += 1
    return copied / (steps - steps // 3)


def main() -> None:
    ap = bench_parser(__doc__, rounds=1)
    ap.add_argument("--candidates", default="files,segments,sqlite")
    ap.add_argument("--mib", type=int, default=256, help="bytes written per item size")
    ap.add_argument("--open-gb", type=float, default=0.0)
    ap.add_argument("--open-small-gb", type=float, default=0.0)
    ap.add_argument("--crash", type=int, default=0, help="kill -9 runs per candidate")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--no-table", action="store_true", help="skip the per-size throughput table")
    ap.add_argument("--amplification", action="store_true", help="segments: compaction model")
    ap.add_argument("--writers", default="", help="files: writer threads to compare, e.g. 1,2,4")
    args = ap.parse_args()
    bench = Bench("bench_disk_store", args)
    results: dict[str, list[dict[str, object]]] = {
        "throughput": [],
        "open": [],
        "amplification": [],
        "crash": [],
    }
    names = args.candidates.split(",")
    if args.writers:  # files with N writer threads, side by side (same machine, same run)
        for n in args.writers.split(","):
            CANDIDATES[f"files{n}"] = _files_with(int(n))
            FILES_PER_GB[f"files{n}"] = FILES_PER_GB["files"]
        names = [n for n in names if n != "files"] + [f"files{n}" for n in args.writers.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-disk-store-", dir=args.dir))
    try:
        print(
            f"{'layout':9} {'item':10} {'size':>9} {'write MB/s':>10} {'read warm':>10} {'read cold':>10} {'files/GB':>9}"
        )
        for label, size in [] if args.no_table else SIZES:
            rounds: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}

            def case(name: str, size: int = size, out: dict[str, list] = rounds) -> Callable[[], None]:
                return lambda: out[name].append(throughput(name, root, size, args.mib * MiB))

            interleaved({name: case(name) for name in names}, args.rounds)
            for name in names:
                w, rw, rc = (spread(x)["median"] for x in zip(*rounds[name], strict=True))
                fpg = FILES_PER_GB[name](size)
                print(
                    f"{name:9} {label:10} {size // KiB:>7}Ki {w:>10.0f} {rw:>10.0f} {rc:>10.0f} {fpg:>9.0f}",
                    flush=True,
                )
                results["throughput"].append(
                    {"layout": name, "item": label, "size": size, "mb_s": rounds[name], "files_per_gb": fpg}
                )
        for gb, kv, ckpt, label in (
            (args.open_gb, 384 * KiB, 19 * MiB, "0.8B mix"),
            (args.open_small_gb, 16 * KiB, 0, "16 KiB only"),
        ):
            for name in names if gb else []:
                items, w, r = open_time(name, root, int(gb * (1 << 30)), kv, ckpt)
                results["open"].append(
                    {"layout": name, "gb": gb, "mix": label, "items": items, "write_s": w, "reopen_s": r}
                )
                print(
                    f"open {name:9} {gb:g} GB {label}: {items} items, written in {w:.1f} s, reopened in {r * 1e3:.0f} ms",
                    flush=True,
                )
        for slack in (0.1, 0.2, 0.3, 0.5) if args.amplification else ():
            amp = compaction_amplification(slack)
            results["amplification"].append({"slack": slack, "copied_per_written": amp})
            print(f"segments compaction at {slack:.0%} slack: {amp:.2f} copied per written", flush=True)
        for name in names if args.crash else []:
            listed, bad, partial = crash(name, root, args.crash)
            results["crash"].append({"layout": name, "listed": listed, "bad": bad, "torn": partial})
            print(
                f"crash {name:9} {args.crash} x kill -9: {listed} items listed, {bad} failed to verify"
                f" ({partial} torn writes left in tmp/)",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(describe_box(bench.before))
    bench.write(args.json, results)


if __name__ == "__main__":
    main()
