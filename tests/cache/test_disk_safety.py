"""The disk store touches only what it made, follows no link, and no read stalls the others.

Ownership (``cache/disk_layout.py``): a non-empty folder that is not a store is refused
untouched; a store's set-aside moves only the store's own entries; only marked set-asides are
ever removed. Links: a link in ``items/``, at an item's name, at a temporary's name or at the
lock is never followed (its target is byte-identical afterwards). Reads: a FIFO is a miss at
once; a stuck read holds neither the other fetches nor ``close``. Manifests of any shape are
"not a manifest", never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from deltaserve.cache import disk_store
from deltaserve.cache.disk_layout import MANIFEST_MAX_BYTES, SET_ASIDE_MARKER, STORE_MAGIC
from deltaserve.cache.disk_reader import ReaderPool
from deltaserve.cache.disk_store import DiskStore, DiskStoreError, ItemKind, item_name
from deltaserve.cache.disk_tier import DiskTier
from deltaserve.cache.types import DiskItemKind
from tests.cache.test_disk_store import IDENT, REPO, _capture, item_file, payload_for, put_all

KV, CP = ItemKind.KV, ItemKind.CHECKPOINT
OTHER = msgspec.structs.replace(IDENT, weights="other-weights")


@pytest.fixture
def store(tmp_path: Path):
    s = DiskStore(tmp_path / "store", 64 << 20, IDENT)
    yield s
    s.close()


def snapshot(root: Path) -> dict[str, tuple[str, bytes | str]]:
    """Every entry under ``root`` (links not followed): its type and its bytes or target."""
    out: dict[str, tuple[str, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", b"")
            else:
                out[rel] = ("file", p.read_bytes())
    return out


def home_like(root: Path) -> None:
    """A user's folder, some of its names the store's own."""
    (root / ".ssh").mkdir(parents=True)
    (root / ".ssh" / "id_ed25519").write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (root / ".bashrc").write_text("export PATH=$HOME/bin:$PATH\n")
    (root / "Documents").mkdir()
    (root / "Documents" / "notes.txt").write_text("do not lose\n")
    (root / "tmp").mkdir()
    (root / "tmp" / "draft.txt").write_text("a draft\n")
    (root / "items").mkdir()
    (root / "items" / "list.csv").write_text("a,b\n")
    (root / "index.bin").write_bytes(b"\x00user data\x01")
    (root / "manifest.json").write_text('{"name": "my web app", "icons": []}')


def _refusal(path: Path, reason: str) -> str:
    return (
        f"{path} is not a deltaserve disk store and is not empty (manifest.json: {reason}); "
        "choose an empty folder or a new path"
    )


# ---------------------------------------------------------------------- ownership
def test_a_foreign_folder_is_refused_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.mkdir()
    (path / ".hidden").write_bytes(b"dot")
    (path / "report.pdf").write_bytes(b"%PDF-1.7 \x00\xff")
    (path / "sub").mkdir()
    (path / "sub" / "a.txt").write_text("a")
    before = snapshot(path)
    with pytest.raises(DiskStoreError) as err:
        DiskStore(path, 1 << 20, IDENT)
    assert type(err.value) is DiskStoreError
    assert str(err.value) == _refusal(path, "missing")
    assert snapshot(path) == before  # nothing renamed, removed or created (not even a lock)


def test_a_home_like_folder_is_refused_and_untouched(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home_like(home)
    before = snapshot(home)
    with pytest.raises(DiskStoreError) as err:
        DiskStore(home, 1 << 20, IDENT)
    assert str(err.value) == _refusal(home, "identity invalid (ValidationError)")
    assert snapshot(home) == before


def test_store_like_names_alone_do_not_make_a_store(tmp_path: Path) -> None:
    path = tmp_path / "project"
    (path / "items").mkdir(parents=True)  # empty: no fan folder of item files
    (path / "tmp").mkdir()
    (path / "tmp" / "draft.txt").write_text("a draft")
    (path / "manifest.json").write_text('{"name": "my web app"}')
    before = snapshot(path)
    with pytest.raises(DiskStoreError, match="is not a deltaserve disk store and is not empty"):
        DiskStore(path, 1 << 20, IDENT)
    assert snapshot(path) == before


def test_empty_and_missing_paths_become_stores_and_a_linked_path_is_followed(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)  # the path the user gives may be a link
    for path in (tmp_path / "empty", tmp_path / "missing" / "deep", tmp_path / "link"):
        with DiskStore(path, 1 << 20, IDENT) as s:
            put_all(s, [(KV, 1, 0, 1000, 0.0)])
        with DiskStore(path, 1 << 20, IDENT) as s:
            assert s.read(KV, 1) == payload_for(1, 1000) and s.describe()["set_aside"] is None
        assert msgspec.json.decode((path / "manifest.json").read_bytes())["magic"] == STORE_MAGIC
    assert (real / "manifest.json").is_file()


def test_set_aside_moves_only_the_stores_own_entries(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0)])
    (path / "README.txt").write_text("the user's, beside the store")
    (path / ".env").write_text("SECRET=1")
    mine = {n: snapshot(path)[n] for n in ("README.txt", ".env")}
    with DiskStore(path, 1 << 20, OTHER) as s:
        aside = Path(str(s.describe()["set_aside"]))
    assert {n: snapshot(path)[n] for n in mine} == mine  # still where the user put them
    assert sorted(p.name for p in aside.iterdir()) == sorted(
        ["items", "tmp", "index.bin", "manifest.json", SET_ASIDE_MARKER]
    )


def test_a_legacy_manifest_is_a_store_and_gains_the_marker(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0)])
    manifest = msgspec.json.decode((path / "manifest.json").read_bytes())
    del manifest["magic"]  # what earlier versions wrote
    (path / "manifest.json").write_bytes(msgspec.json.encode(manifest))
    (path / "notes.txt").write_text("the user's")
    with DiskStore(path, 1 << 20, IDENT) as s:
        assert s.read(KV, 1) == payload_for(1, 1000)
    assert msgspec.json.decode((path / "manifest.json").read_bytes())["magic"] == STORE_MAGIC
    assert (path / "notes.txt").read_text() == "the user's"


def test_an_unmarked_set_aside_is_never_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0)])
    old = path / "set-aside-20200101T000000Z"  # as an earlier version left a user's folder
    home_like(old)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    (path / "set-aside-link").symlink_to(victim, target_is_directory=True)
    before_old, before_victim = snapshot(old), snapshot(victim)
    caplog.set_level(logging.WARNING, logger="deltaserve.cache")
    for ident in (OTHER, IDENT, OTHER):  # each open sets the last store aside, removes older marked ones
        with DiskStore(path, 1 << 20, ident) as s:
            newest = s.describe()["set_aside"]
    assert snapshot(old) == before_old and snapshot(victim) == before_victim
    assert (path / "set-aside-link").is_symlink()
    marked = [p for p in path.glob("set-aside-*") if (p / SET_ASIDE_MARKER).is_file()]
    assert [str(p) for p in marked] == [newest]  # our own older ones were removed
    kept = {r.fields["path"] for r in _capture(caplog, "disk_store.set_aside_kept")}
    assert kept == {str(old), str(path / "set-aside-link")}


# ---------------------------------------------------------------------- links
def test_a_linked_folder_under_items_is_never_entered(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0)])
        good = item_file(s, KV, 1)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "photo.jpg").write_bytes(b"\xff\xd8 a photo")
    (victim / "not-an-item").write_text("x")
    key_ff = (0xFF << 120) + 5
    (victim / item_name(KV, key_ff, 0, 1000, 0.0)).write_bytes(good.read_bytes())  # a name it lists
    before = snapshot(victim)
    (path / "items" / "ff").symlink_to(victim, target_is_directory=True)
    with DiskStore(path, 5 * 4096, IDENT) as s:
        assert not s.has(KV, key_ff)
        (path / "items" / "fe").symlink_to(victim, target_is_directory=True)  # planted while open
        key_fe = (0xFE << 120) + 7
        for k in (key_fe, key_ff):  # writes into both fans
            assert s.put(KV, k, 0, payload_for(k, 1000), 0.0) and s.flush(10)
            assert s.read(KV, k) == payload_for(k, 1000)
        for k in range(2, 9):  # and evictions of what is there
            assert s.put(KV, k, 0, payload_for(k, 1000), 0.0) and s.flush(10)
        assert s.stats()["disk.evicted_items"] > 0 and not s.has(KV, key_fe)
    assert snapshot(victim) == before
    assert not (path / "items" / "fe").is_symlink() and not (path / "items" / "ff").is_symlink()


def test_a_linked_item_file_is_a_miss(store: DiskStore, tmp_path: Path) -> None:
    put_all(store, [(KV, 3, 0, 9000, 0.0), (KV, 4, 0, 9000, 0.0)])
    f = item_file(store, KV, 3)
    victim = tmp_path / "victim.bin"
    original = f.read_bytes()
    victim.write_bytes(original)  # the very bytes: it would verify if followed
    f.unlink()
    f.symlink_to(victim)
    assert store.read(KV, 3) is None
    assert store.stats()["disk.damaged_items"] == 1 and not store.has(KV, 3)
    assert victim.read_bytes() == original
    assert not f.is_symlink() and not f.exists()  # the link itself went, not its target
    assert store.read(KV, 4) == payload_for(4, 9000)


@pytest.mark.parametrize("name", ["index.bin.tmp", "manifest.json.tmp", "tmp-item", "lock"])
def test_planted_links_are_never_followed(tmp_path: Path, name: str) -> None:
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0)])
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    missing = tmp_path / "never-created"
    if name == "lock":  # a dangling link: opening it with O_CREAT would create its target
        (path / "lock").unlink()
        (path / "lock").symlink_to(missing)
        with pytest.raises(DiskStoreError, match="cannot lock disk store"):
            DiskStore(path, 1 << 20, IDENT)
        assert not missing.exists() and (path / "lock").is_symlink()
        return
    if name == "manifest.json.tmp":  # written when a legacy manifest gains its marker
        manifest = msgspec.json.decode((path / "manifest.json").read_bytes())
        del manifest["magic"]
        (path / "manifest.json").write_bytes(msgspec.json.encode(manifest))
    if name != "tmp-item":  # before the open (the index is written at close)
        (path / name).symlink_to(victim)
    with DiskStore(path, 1 << 20, IDENT) as s:
        if name == "tmp-item":  # while open: the name the next write creates
            (path / "tmp" / item_name(KV, 2, 0, 1000, 0.0)).symlink_to(victim)
        assert s.put(KV, 2, 0, payload_for(2, 1000), 0.0) and s.flush(10)
        assert s.read(KV, 2) == payload_for(2, 1000)
    with DiskStore(path, 1 << 20, IDENT) as s:  # the manifest and the index read back
        assert s.read(KV, 2) == payload_for(2, 1000) and s.describe()["set_aside"] is None
    assert victim.read_text() == "precious"
    assert not (path / "index.bin").is_symlink() and not (path / "manifest.json").is_symlink()


# ---------------------------------------------------------------------- reads
def _unblock_fifo(fifo: Path) -> None:
    """Release a reader blocked on ``fifo`` (old code), so the test process can end."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_fifo_in_items_is_a_quick_miss(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0), (KV, 2, 0, 1000, 0.0), (KV, 3, 0, 1000, 0.0)])
        f1, f3 = item_file(s, KV, 1), item_file(s, KV, 3)
    f3.unlink()
    os.mkfifo(f3)  # present at open: the listing drops it, never reads it
    s = DiskStore(path, 1 << 20, IDENT)
    try:
        assert not s.has(KV, 3) and not f3.exists()
        f1.unlink()
        os.mkfifo(f1)  # planted after the open
        result: list[bytes | None] = []
        t0 = time.monotonic()
        reader = threading.Thread(target=lambda: result.append(s.read(KV, 1)), daemon=True)
        reader.start()
        reader.join(5)
        elapsed = time.monotonic() - t0
        assert not reader.is_alive() and result == [None] and elapsed < 1.0
        assert s.read(KV, 2) == payload_for(2, 1000)  # the others are served
    finally:
        _unblock_fifo(f1)
        t0 = time.monotonic()
        s.close()
        assert time.monotonic() - t0 < 5.0


def test_a_read_in_flight_at_close_touches_nothing_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read still running when its store closes returns None and does not touch what the
    next store on the path owns (its item file stays)."""
    path = tmp_path / "s"
    with DiskStore(path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0)])
    gate, entered = threading.Event(), threading.Event()
    real = disk_store.decode_header

    def stuck(raw: bytes):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "stuck-reader":
            entered.set()
            gate.wait(30)
            return None  # as if damaged: the old store must not act on it now
        return real(raw)

    monkeypatch.setattr(disk_store, "decode_header", stuck)
    first = DiskStore(path, 1 << 20, IDENT)
    result: list[bytes | None] = []
    t = threading.Thread(target=lambda: result.append(first.read(KV, 1)), name="stuck-reader", daemon=True)
    t.start()
    assert entered.wait(10)
    t0 = time.monotonic()
    first.close()
    assert time.monotonic() - t0 < 5.0
    with DiskStore(path, 1 << 20, IDENT) as second:  # the lock was released
        f = item_file(second, KV, 1)
        gate.set()
        t.join(10)
        assert result == [None] and f.exists()
        assert second.read(KV, 1) == payload_for(1, 1000)


class _BlockingStore:
    """The tier's store over a dict; reads of ``stuck`` keys block until ``gate`` is set."""

    def __init__(self, keys: list[int], stuck: set[int]) -> None:
        self.keys, self.stuck = set(keys), stuck
        self.gate = threading.Event()
        self.closed = False

    def has(self, kind: DiskItemKind, key: int) -> bool:
        return key in self.keys

    def queued(self, kind: DiskItemKind, key: int) -> bool:
        return False

    def put(self, kind: DiskItemKind, key: int, parent: int, payload: bytes, cost: float) -> bool:
        return False

    def read(self, kind: DiskItemKind, key: int) -> bytes | None:
        if key in self.stuck:
            self.gate.wait(60)
        return bytes(8 if kind is DiskItemKind.KV else 16)

    def stats(self) -> dict[str, int | float]:
        return {}

    def close(self) -> None:
        self.closed = True


def test_a_stuck_read_holds_no_other_fetch_and_not_close() -> None:
    store = _BlockingStore([1, 2, 3, 4], stuck={1})
    tier = DiskTier(
        store, block_size=16, unit_blocks=1, kv_block_bytes=8, checkpoint_bytes=16, read_timeout_s=0.5
    )
    try:
        stuck = tier.fetch("stuck", [1, 2], 0, 2)
        ok = tier.fetch("ok", [3, 4], 0, 2)
        assert stuck is not None and ok is not None
        deadline = time.monotonic() + 10
        while not ok.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ok.done and tier.usable(ok, 0) and ok.end_block == 2
        assert not stuck.done
        time.sleep(0.6)  # past its deadline: given up, its request goes on (None: no disk hit)
        assert tier.fetch("stuck", [1, 2], 0, 2) is None
        assert tier.stats()["disk.read_timeouts"] == 1 and stuck.done and not tier.usable(stuck, 0)
        assert tier.fetch("stuck", [1, 2], 0, 2) is None  # not read again
        assert tier.buffered == ok.nbytes
        t0 = time.monotonic()
        tier.close()
        assert time.monotonic() - t0 < 2.0 and store.closed
    finally:
        store.gate.set()


def test_the_reader_pool_runs_around_stuck_tasks_and_never_holds_exit() -> None:
    gate = threading.Event()
    pool = ReaderPool(threads=3)
    try:
        stuck = [pool.submit(gate.wait, 60) for _ in range(2)]
        quick = [pool.submit(lambda i=i: i * i) for i in range(5)]
        assert [f.result(timeout=10) for f in quick] == [0, 1, 4, 9, 16]  # on the third thread
        assert not any(f.done() for f in stuck)
        third = pool.submit(gate.wait, 60)
        deadline = time.monotonic() + 10
        while not third.running() and time.monotonic() < deadline:
            time.sleep(0.005)
        queued = pool.submit(lambda: 1)  # behind three stuck tasks
        t0 = time.monotonic()
        pool.shutdown(wait=False, cancel_futures=True)
        assert time.monotonic() - t0 < 1.0 and queued.cancelled() and not third.done()
        with pytest.raises(RuntimeError):
            pool.submit(lambda: 1)
    finally:
        gate.set()
    # a task stuck for good does not hold the interpreter's exit (a ThreadPoolExecutor's would)
    code = "import threading; from deltaserve.cache.disk_reader import ReaderPool; ReaderPool().submit(threading.Event().wait)"
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60
    )
    assert out.returncode == 0 and time.monotonic() - t0 < 30


# ---------------------------------------------------------------------- manifests
BAD_MANIFESTS = {
    "nested": b'{"x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
    "nested-identity": b'{"magic": "deltaserve-disk-store", "identity": '
    + b"[" * 30_000
    + b"]" * 30_000
    + b"}",
    "wrong-types": b'{"identity": 5, "created": "yesterday"}',
    "binary": bytes(range(256)) * 8,
    "huge": b'{"identity": {}, "pad": "' + b"x" * (MANIFEST_MAX_BYTES + 10) + b'"}',
    "list": b"[1, 2, 3]",
}


@pytest.mark.parametrize("kind", sorted(BAD_MANIFESTS))
def test_a_bad_manifest_is_set_aside_in_a_store_and_refused_elsewhere(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    store_path, home = tmp_path / "s", tmp_path / "home"
    with DiskStore(store_path, 1 << 20, IDENT) as s:
        put_all(s, [(KV, 1, 0, 1000, 0.0)])
    (store_path / "manifest.json").write_bytes(BAD_MANIFESTS[kind])
    caplog.set_level(logging.WARNING, logger="deltaserve.cache")
    # clearly a store (only its names, items/ of fan folders): set aside, the store starts
    # empty; elsewhere, the same manifest marks nothing ours (even with the magic: its
    # identity cannot be read past, so no field of it is trusted)
    with DiskStore(store_path, 1 << 20, IDENT) as s:
        assert s.describe()["set_aside"] is not None and s.items() == []
    (rec,) = _capture(caplog, "disk_store.set_aside")
    assert rec.fields["reason"].startswith("manifest.json ")
    assert not any(r.exc_info for r in caplog.records)
    home_like(home)
    (home / "manifest.json").write_bytes(BAD_MANIFESTS[kind])
    before = snapshot(home)
    with pytest.raises(DiskStoreError) as err:
        DiskStore(home, 1 << 20, IDENT)
    assert "is not a deltaserve disk store and is not empty" in str(err.value)
    assert "\n" not in str(err.value)
    assert snapshot(home) == before
