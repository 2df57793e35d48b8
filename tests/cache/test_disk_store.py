"""The disk store: round trips, restart, set-aside, damage, locking, crashes, the write queue
(capacity and eviction: test_disk_store_eviction.py)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from array import array
from pathlib import Path

import msgspec
import pytest

from deltaserve.cache import disk_store
from deltaserve.cache.disk_store import (
    FORMAT_VERSION,
    HEADER_BYTES,
    DiskStore,
    DiskStoreError,
    DiskStoreLocked,
    accounted_bytes,
)
from tests.cache.disk_store_cases import CP, IDENT, KV, REPO, UNIT, item_file, payload_for, put_all


@pytest.fixture
def store(tmp_path: Path):
    s = DiskStore(tmp_path / "store", 64 << 20, IDENT)
    yield s
    s.close()


# ---------------------------------------------------------------------- basics
def test_round_trip_and_stats(store: DiskStore) -> None:
    key = (1 << 127) + 12345
    data = payload_for(key, 100_000)
    assert store.put(KV, key, 0, bytearray(data), 0.0)
    assert store.flush(10)
    assert store.has(KV, key) and not store.queued(KV, key)
    assert not store.has(CP, key)
    assert store.read(KV, key) == data
    assert store.read(CP, key) is None
    st = store.stats()
    assert st["disk.items"] == 1
    assert st["disk.bytes"] == accounted_bytes(100_000) == 25 * UNIT
    assert st["disk.bytes_written"] == 100_000 and st["disk.items_written"] == 1
    assert st["disk.bytes_read"] == 100_000 and st["disk.items_read"] == 1
    assert st["disk.queue_drops"] == 0 and st["disk.queue_items"] == 0
    # stored or queued again: refused and counted
    assert not store.put(KV, key, 0, data, 0.0)
    assert store.stats()["disk.queue_drops"] == 1
    assert store.items() == [(KV, key)]


def test_bad_input_is_a_typed_error(store: DiskStore, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="128-bit"):
        store.put(KV, 1 << 128, 0, b"x", 0.0)
    with pytest.raises(ValueError, match="cost"):
        store.put(KV, 1, 0, b"x", float("nan"))
    with pytest.raises(ValueError, match="ItemKind"):
        store.put(1, 1, 0, b"x", 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size must be > 0"):
        msgspec.structs.replace(IDENT, block_size=0)
    with pytest.raises(DiskStoreError, match="format"):
        DiskStore(tmp_path / "other", 1 << 20, msgspec.structs.replace(IDENT, format=99))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(DiskStoreError, match="cannot create disk store .*file/s"):
        DiskStore(tmp_path / "file" / "s", 1 << 20, IDENT)  # a file where a directory must be
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskStore(tmp_path / "other", 0, IDENT)


def test_memoryview_payload_is_copied(store: DiskStore) -> None:
    buf = bytearray(b"a" * 5000)
    assert store.put(KV, 7, 0, memoryview(buf), 0.0)
    buf[:] = b"b" * 5000  # the caller reuses its buffer at once
    assert store.flush(10)
    assert store.read(KV, 7) == b"a" * 5000
    words = array("f", [1.5] * 1000)  # a typed view: its bytes, not its item count, are stored
    assert store.put(KV, 8, 0, memoryview(words), 0.0) and store.flush(10)
    assert store.read(KV, 8) == words.tobytes()


def test_restart_serves_the_same_items(tmp_path: Path) -> None:
    path = tmp_path / "s"
    keys = [(KV, k, k - 1 if k > 1 else 0, 3000 + k, 0.0) for k in range(1, 6)]
    keys.append((CP, 5, 5, 20000, 80.0))
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, keys)
        before = s.stats()
        created = s.describe()["age_s"]
    with DiskStore(path, 1 << 20, IDENT) as s:
        for kind, key, _, n, _ in keys:
            assert s.read(kind, key) == payload_for(key, n)
        st = s.stats()
        assert st["disk.items"] == before["disk.items"] == 6
        assert st["disk.bytes"] == before["disk.bytes"]
        assert st["disk.items_read"] == 6 and st["disk.bytes_written"] == 0  # per process
        d = s.describe()
        assert d["set_aside"] is None and d["items"] == 6 and d["path"] == str(path)
        assert d["bytes"] == before["disk.bytes"] and d["capacity"] == 1 << 20
        assert isinstance(d["opened_in_ms"], float) and d["opened_in_ms"] >= 0
        assert isinstance(d["age_s"], float) and d["age_s"] >= created
    # without the saved index (a crash): rebuilt from the item headers
    (path / "index.bin").unlink()
    with DiskStore(path, 1 << 20, IDENT) as s:
        assert sorted(s.items()) == sorted((k[0], k[1]) for k in keys)
        assert s.read(CP, 5) == payload_for(5, 20000)


def test_open_removes_partial_and_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 9, 0, 1000, 0.0), (KV, 10, 9, 1000, 0.0)])
        good, torn = item_file(s, KV, 9), item_file(s, KV, 10)
    partial = path / "tmp" / good.name
    partial.write_bytes(b"half an item")
    junk = [good.parent / "not-an-item", good.parent / f"3-{good.name[2:]}", path / "items" / "zz"]
    junk[0].write_bytes(b"x")
    junk[1].write_bytes(good.read_bytes())
    junk[2].mkdir()
    (junk[2] / good.name).write_bytes(good.read_bytes())  # the right name in a wrong directory
    torn.write_bytes(torn.read_bytes()[: HEADER_BYTES + 10])  # a torn file under its final name
    with DiskStore(path, 1 << 20, IDENT) as s:
        assert sorted(s.items()) == [(KV, 9), (KV, 10)]  # an open lists names, reads no file
        assert not partial.exists() and not any(j.exists() for j in junk[:2])
        assert not (junk[2] / good.name).exists()
        assert s.read(KV, 10) is None and s.read(KV, 9) == payload_for(9, 1000)
        assert s.items() == [(KV, 9)] and s.stats()["disk.damaged_items"] == 1


def test_item_names_round_trip() -> None:
    for cost in (0.0, 1e-300, 0.1, 3.0, 1e300):
        name = disk_store.item_name(CP, (1 << 128) - 1, 5, 19 << 20, cost)
        assert disk_store.parse_item_name(name) == (CP, (1 << 128) - 1, 5, 19 << 20, cost)
    assert disk_store.parse_item_name("1-00-00-10-0x0.0p+0") is None
    assert disk_store.parse_item_name("1-" + "0" * 32 + "-" + "0" * 32 + "-10-nan") is None


# ---------------------------------------------------------------------- identity
def _capture(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


def test_other_identity_is_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0)])
    other = msgspec.structs.replace(IDENT, weights="other-weights")
    caplog.set_level(logging.WARNING, logger="deltaserve.cache")
    with DiskStore(path, 1 << 20, other) as s:
        assert s.items() == [] and not s.has(KV, 1) and s.read(KV, 1) is None
        aside = s.describe()["set_aside"]
        assert isinstance(aside, str) and Path(aside).parent == path
        assert Path(aside, "items").is_dir() and Path(aside, "manifest.json").is_file()
        put_all(s, [(KV, 2, 0, 1000, 0.0)])
    (rec,) = _capture(caplog, "disk_store.set_aside")
    assert rec.fields["differs"] == {"weights": {"store": "w-hash", "ours": "other-weights"}}
    # the set-aside store is never read back, even by the identity that wrote it
    with DiskStore(path, 1 << 20, IDENT) as s:
        assert s.items() == []
        newest = s.describe()["set_aside"]
    # one generation is kept: the first store set aside is gone, the second (other's) stays
    (kept,) = path.glob("set-aside-*")
    assert (
        str(kept) == newest
        and msgspec.json.decode((kept / "manifest.json").read_bytes())["identity"]["weights"]
        == "other-weights"
    )
    assert [r.fields["path"] for r in _capture(caplog, "disk_store.set_aside_removed")] == [aside]


def test_format_mismatch_is_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0)])
    manifest = msgspec.json.decode((path / "manifest.json").read_bytes())
    assert manifest["identity"]["format"] == FORMAT_VERSION
    manifest["identity"]["format"] = FORMAT_VERSION - 1
    (path / "manifest.json").write_bytes(msgspec.json.encode(manifest))
    caplog.set_level(logging.WARNING, logger="deltaserve.cache")
    with DiskStore(path, 1 << 20, IDENT) as s:
        assert s.items() == [] and s.describe()["set_aside"] is not None
    (rec,) = _capture(caplog, "disk_store.set_aside")
    assert rec.fields["differs"] == {"format": {"store": FORMAT_VERSION - 1, "ours": FORMAT_VERSION}}


def test_unreadable_manifest_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0)])
    (path / "manifest.json").write_bytes(b"{not json")
    with DiskStore(path, 1 << 20, IDENT) as s:
        assert s.items() == [] and s.describe()["set_aside"] is not None


# ---------------------------------------------------------------------- damage
@pytest.mark.parametrize("damage", ["payload_byte", "header_byte", "truncate", "extend", "delete"])
def test_damaged_item_is_a_counted_miss(store: DiskStore, damage: str) -> None:
    put_all(store, [(KV, 3, 0, 9000, 0.0), (KV, 4, 3, 9000, 0.0)])
    f = item_file(store, KV, 3)
    raw = bytearray(f.read_bytes())
    if damage == "payload_byte":
        raw[HEADER_BYTES + 4321] ^= 0x01
        f.write_bytes(raw)
    elif damage == "header_byte":
        raw[30] ^= 0x80
        f.write_bytes(raw)
    elif damage == "truncate":
        f.write_bytes(raw[:-1])
    elif damage == "extend":
        f.write_bytes(raw + b"\0")
    else:
        f.unlink()
    assert store.read(KV, 3) is None
    assert not store.has(KV, 3) and not f.exists()
    assert store.stats()["disk.damaged_items"] == 1
    assert store.read(KV, 3) is None  # forgotten: a plain miss now, not counted twice
    assert store.stats()["disk.damaged_items"] == 1
    assert store.read(KV, 4) == payload_for(4, 9000)  # the others are untouched
    assert store.put(KV, 3, 0, payload_for(3, 9000), 0.0)  # and it can be stored again
    assert store.flush(10) and store.read(KV, 3) == payload_for(3, 9000)


def test_swapped_file_does_not_verify(store: DiskStore) -> None:
    put_all(store, [(KV, 3, 0, 9000, 0.0), (KV, 4, 0, 9000, 0.0)])
    item_file(store, KV, 4).write_bytes(item_file(store, KV, 3).read_bytes())
    assert store.read(KV, 4) is None
    assert store.read(KV, 3) == payload_for(3, 9000)


# ---------------------------------------------------------------------- locking
def test_second_store_on_a_path_is_locked(store: DiskStore) -> None:
    with pytest.raises(DiskStoreLocked, match=str(store.path)):
        DiskStore(store.path, 1 << 20, IDENT)
    assert store.put(KV, 1, 0, b"ok", 0.0) and store.flush(10)  # the holder is unaffected


def _run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


_CHILD_HEADER = """
import sys
from deltaserve.cache.disk_store import DiskStore, DiskStoreLocked, ItemKind, StoreIdentity
IDENT = StoreIdentity(model="cfg-hash", weights="w-hash", dtype="bfloat16", block_size=16,
    gdn_chunk_size=64, salt_rule="salt-v1", kv_block_bytes=16384, checkpoint_bytes=204800)
"""


def test_locked_across_processes(store: DiskStore) -> None:
    code = (
        _CHILD_HEADER
        + """
try:
    DiskStore(sys.argv[1], 1 << 20, IDENT)
except DiskStoreLocked as e:
    print("LOCKED", e)
    sys.exit(3)
"""
    )
    out = _run_child(code, str(store.path))
    assert out.returncode == 3, out.stderr
    assert out.stdout.startswith("LOCKED") and str(store.path) in out.stdout
    store.close()
    out = _run_child(code, str(store.path))
    assert out.returncode == 0, out.stderr  # released by close


def test_kill_during_writes_leaves_only_complete_items(tmp_path: Path) -> None:
    path = tmp_path / "s"
    code = (
        _CHILD_HEADER
        + """
s = DiskStore(sys.argv[1], 64 << 20, IDENT, queue_items=64, queue_bytes=64 << 20)
k = 0
while True:
    k += 1
    n = 1000 + (k * 7919) % (3 << 20)  # 1 KB .. 3 MB: kills land inside writes
    seed = k.to_bytes(16, "little")
    s.put(ItemKind.KV, k, k - 1, (seed * (n // 16 + 1))[:n], 0.0)
    if k == 40:
        print("WRITING", flush=True)
"""
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for _ in range(3):  # three crashes in a row, each reopened by the next child
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(path)], env=env, stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "WRITING"
        time.sleep(0.5)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    with DiskStore(path, 64 << 20, IDENT) as s:
        listed = s.items()
        assert len(listed) > 5
        for kind, key in listed:
            data = s.read(kind, key)
            n = 1000 + (key * 7919) % (3 << 20)
            assert data == payload_for(key, n)
        assert s.stats()["disk.damaged_items"] == 0
        assert s.stats()["disk.bytes"] <= 64 << 20
        assert list((path / "tmp").iterdir()) == []


# ---------------------------------------------------------------------- queue and errors
@pytest.fixture
def slow_writer(monkeypatch: pytest.MonkeyPatch):
    """The writer blocks inside its first write until the event is set."""
    gate = threading.Event()
    real = disk_store._write_file

    def slow(fd: int, header: bytes, payload: bytes) -> None:
        gate.wait(30)
        real(fd, header, payload)

    monkeypatch.setattr(disk_store, "_write_file", slow)
    yield gate
    gate.set()


def _wait_writer_busy(store: DiskStore) -> None:
    """Until the writers have taken what is queued (and are stuck writing it)."""
    deadline = time.monotonic() + 10
    while store.stats()["disk.queue_items"] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert store.stats()["disk.queue_items"] == 0


def test_full_queue_drops_fast(tmp_path: Path, slow_writer: threading.Event) -> None:
    with DiskStore(tmp_path / "s", 64 << 20, IDENT, queue_items=3) as s:
        try:
            busy = disk_store.WRITER_THREADS  # each writer takes one item and is stuck in it
            assert all(s.put(KV, k, 0, payload_for(k, 1000), 0.0) for k in range(1, busy + 1))
            _wait_writer_busy(s)
            queued = range(busy + 1, busy + 4)
            assert all(s.put(KV, k, 0, payload_for(k, 1000), 0.0) for k in queued)
            t0 = time.perf_counter()
            results = [s.put(KV, k, 0, payload_for(k, 1000), 0.0) for k in range(100, 200)]
            elapsed = time.perf_counter() - t0
            assert not any(results) and elapsed < 0.5
            st = s.stats()
            assert st["disk.queue_drops"] == 100 and st["disk.queue_items"] == 3
            assert all(s.queued(KV, k) and not s.has(KV, k) for k in queued)
            assert not s.flush(0.05)
        finally:
            slow_writer.set()
        assert s.flush(10) and all(s.has(KV, k) and not s.queued(KV, k) for k in queued)


def test_queue_bytes_bound(tmp_path: Path, slow_writer: threading.Event) -> None:
    with DiskStore(tmp_path / "s", 64 << 20, IDENT, queue_bytes=10_000) as s:
        try:
            assert s.put(KV, 1, 0, b"x" * 6000, 0.0)
            _wait_writer_busy(s)  # an item being written still holds its queue bytes
            assert s.stats()["disk.queue_bytes"] == 6000
            assert not s.put(KV, 2, 0, b"x" * 6000, 0.0)
            assert s.put(KV, 3, 0, b"x" * 4000, 0.0)
            assert s.stats()["disk.queue_drops"] == 1
        finally:
            slow_writer.set()
        assert s.flush(10) and s.has(KV, 1) and s.has(KV, 3) and not s.has(KV, 2)


def test_write_error_drops_and_store_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = disk_store._write_file
    fail = {"left": 3}

    def flaky(fd: int, header: bytes, payload: bytes) -> None:
        if fail["left"]:
            fail["left"] -= 1
            os.write(fd, header[:10])  # a partial file, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, header, payload)

    monkeypatch.setattr(disk_store, "_write_file", flaky)
    caplog.set_level(logging.WARNING, logger="deltaserve.cache")
    with DiskStore(tmp_path / "s", 1 << 20, IDENT) as s:
        for k in (1, 2, 3, 4):
            assert s.put(KV, k, k - 1, payload_for(k, 2000), 0.0)
        assert s.flush(10)
        st = s.stats()
        assert st["disk.write_errors"] == 3 and st["disk.items"] == 1 and st["disk.bytes"] == UNIT
        (ok,) = [i for i in range(1, 5) if s.has(KV, i)]  # the writers race for the 4th call
        assert s.read(KV, ok) == payload_for(ok, 2000)
        assert list((s.path / "tmp").iterdir()) == []
        again = 1 if ok != 1 else 2
        assert s.put(KV, again, 0, payload_for(again, 2000), 0.0) and s.flush(10)
        assert s.read(KV, again) == payload_for(again, 2000)
    (rec,) = _capture(caplog, "disk_store.write_error")  # logged once, not per item
    assert rec.fields["error"] == "ENOSPC"


def test_close_flushes_and_is_idempotent(tmp_path: Path, slow_writer: threading.Event) -> None:
    s = DiskStore(tmp_path / "s", 1 << 20, IDENT)
    for k in range(1, 4):
        assert s.put(KV, k, 0, payload_for(k, 500), 0.0)
    threading.Timer(0.2, slow_writer.set).start()
    s.close()
    s.close()
    assert not s.put(KV, 9, 0, b"x", 0.0)
    assert s.read(KV, 1) is None  # the lock is released: a closed store serves nothing
    with DiskStore(tmp_path / "s", 1 << 20, IDENT) as s2:
        assert sorted(s2.items()) == [(KV, 1), (KV, 2), (KV, 3)]
