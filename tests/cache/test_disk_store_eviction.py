"""The disk store's capacity and eviction: what goes first, value per exclusive byte, reads and
restarts, and the capacity never exceeded."""

from __future__ import annotations

import threading
from pathlib import Path

from deltaserve.cache.disk_store import HEADER_BYTES, DiskStore, ItemKind, accounted_bytes
from tests.cache.disk_store_cases import CP, IDENT, KV, SMALL, UNIT, payload_for, put_all


def _present(store: DiskStore, items: list[tuple[ItemKind, int]]) -> list[tuple[ItemKind, int]]:
    return [i for i in items if store.has(*i)]


def _fill(store: DiskStore, n: int, start: int = 1000) -> None:
    """n one-block items worth so much that they never go: they only push the others out."""
    for k in range(start, start + n):
        assert store.put(CP, k, 0, payload_for(k, SMALL), 1e12)
        assert store.flush(10)


def test_eviction_leaves_first_and_checkpointless_first(tmp_path: Path) -> None:
    # a1 - a2 (+ checkpoint on a2); b1 - b2 (no checkpoint): 5 one-block items
    items = [
        (KV, 11, 0, SMALL, 0.0),
        (KV, 12, 11, SMALL, 0.0),
        (CP, 12, 12, SMALL, 64.0),
        (KV, 21, 0, SMALL, 0.0),
        (KV, 22, 21, SMALL, 0.0),
    ]
    with DiskStore(tmp_path / "s", 5 * UNIT, IDENT) as s:
        put_all(s, items)
        order = []
        remaining = [(k, key) for k, key, *_ in items]
        for step in range(5):
            _fill(s, 1, start=1000 + step)
            gone = [i for i in remaining if not s.has(*i)]
            assert len(gone) == 1
            order += gone
            remaining.remove(gone[0])
        assert s.stats()["disk.evicted_items"] == 5
    # the checkpoint-less chain goes first, leaf before parent; then the checkpoint, then
    # its KV path (leaf first)
    assert order == [(KV, 22), (KV, 21), (CP, 12), (KV, 12), (KV, 11)]


def test_eviction_by_value_per_exclusive_byte(tmp_path: Path) -> None:
    # r forks into x1-x2-x3 and y1; equal-cost checkpoints on r, y1 and x3. Exclusive bytes:
    # cp(x3) keeps x3, x2, x1 useful (4 blocks), cp(y1) keeps y1 (2), cp(r) only itself (1).
    c = 1000.0
    items = [
        (KV, 1, 0, SMALL, 0.0),
        (CP, 1, 1, SMALL, c),
        (KV, 2, 1, SMALL, 0.0),
        (KV, 3, 2, SMALL, 0.0),
        (KV, 4, 3, SMALL, 0.0),
        (CP, 4, 4, SMALL, c),
        (KV, 5, 1, SMALL, 0.0),
        (CP, 5, 5, SMALL, c),
    ]
    with DiskStore(tmp_path / "s", len(items) * UNIT, IDENT) as s:
        put_all(s, items)
        remaining = [(k, key) for k, key, *_ in items]
        order = []
        for step in range(len(items)):
            _fill(s, 1, start=1000 + step)
            gone = [i for i in remaining if not s.has(*i)]
            assert len(gone) == 1, gone
            order += gone
            remaining.remove(gone[0])
            # a parent never goes before what depends on it
            for kind, key, parent, *_ in items:
                if s.has(kind, key) and parent:
                    assert s.has(KV, parent), (kind, key)
    assert order == [
        (CP, 4),
        (KV, 4),
        (KV, 3),
        (KV, 2),
        (CP, 5),
        (KV, 5),
        (CP, 1),
        (KV, 1),
    ]


def test_reads_raise_value(tmp_path: Path) -> None:
    items = [(KV, 1, 0, SMALL, 0.0), (CP, 1, 1, SMALL, 10.0)]
    items += [(KV, 2, 0, SMALL, 0.0), (CP, 2, 2, SMALL, 10.0)]
    with DiskStore(tmp_path / "s", 4 * UNIT, IDENT) as s:
        put_all(s, items)
        for _ in range(3):
            assert s.read(CP, 1) is not None
        _fill(s, 1)
        assert not s.has(CP, 2) and s.has(CP, 1)  # the one never read goes


def test_frequency_survives_restart(tmp_path: Path) -> None:
    items = [(CP, 1, 0, SMALL, 10.0), (CP, 2, 0, SMALL, 10.0)]
    with DiskStore(tmp_path / "s", 2 * UNIT, IDENT) as s:
        put_all(s, items)
        assert s.read(CP, 2) is not None
    with DiskStore(tmp_path / "s", 2 * UNIT, IDENT) as s:
        _fill(s, 1)
        assert s.has(CP, 2) and not s.has(CP, 1)


def test_queued_dependents_protect_their_parent(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "s", 2 * UNIT, IDENT) as s:
        put_all(s, [(KV, 1, 0, SMALL, 0.0), (KV, 5, 0, SMALL, 0.0)])
        # KV 2 and the checkpoint on it are queued together: KV 1 (a leaf until now, and
        # older than KV 5) must not go to make room for its own child
        assert s.put(KV, 2, 1, payload_for(2, SMALL), 0.0)
        assert s.put(CP, 2, 2, payload_for(2, SMALL), 50.0)
        assert s.flush(10)
        assert sorted(s.items()) == [(KV, 1), (KV, 2)]
        # nothing could go for the checkpoint (its path is all it depends on): refused
        assert s.stats()["disk.queue_drops"] == 1 and s.stats()["disk.evicted_items"] == 1
        _fill(s, 1)  # KV 2 is a leaf again once the checkpoint is given up
        assert sorted(s.items()) == [(KV, 1), (CP, 1000)]


def test_reads_race_evictions_safely(tmp_path: Path) -> None:
    sizes = {k: 1000 + (k * 4099) % 9000 for k in range(1, 400)}
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader(s: DiskStore) -> None:
        try:
            while not stop.is_set():
                for k in range(1, 400, 7):
                    data = s.read(KV, k)
                    assert data is None or data == payload_for(k, sizes[k])
        except BaseException as e:  # surfaced below
            errors.append(e)

    with DiskStore(tmp_path / "s", 20 * UNIT, IDENT, queue_items=8) as s:
        t = threading.Thread(target=reader, args=(s,))
        t.start()
        for k, n in sizes.items():
            while not s.put(KV, k, 0, payload_for(k, n), 0.0):
                s.flush(1)
        assert s.flush(10)
        stop.set()
        t.join()
        st = s.stats()
        assert errors == [] and st["disk.damaged_items"] == 0
        assert st["disk.evicted_items"] == len(sizes) - st["disk.items"] > 300


def test_smaller_capacity_at_open_evicts(tmp_path: Path) -> None:
    items = [(KV, 1, 0, SMALL, 0.0), (CP, 1, 1, SMALL, 5.0), (KV, 2, 0, SMALL, 0.0)]
    with DiskStore(tmp_path / "s", 3 * UNIT, IDENT) as s:
        put_all(s, items)
    with DiskStore(tmp_path / "s", 2 * UNIT, IDENT) as s:
        assert sorted(s.items()) == [(KV, 1), (CP, 1)]  # the checkpoint-less leaf went
        assert s.stats()["disk.evicted_items"] == 1 and s.stats()["disk.bytes"] == 2 * UNIT
        assert len(list((s.path / "items").rglob("*-*"))) == 2


def test_heap_stays_bounded_under_reads(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "s", 1 << 20, IDENT) as s:
        put_all(s, [(CP, k, 0, 100, 1.0) for k in range(1, 11)])
        for _ in range(500):
            for k in range(1, 11):
                assert s.read(CP, k) == payload_for(k, 100)
        # every read re-prices its item and leaves a stale heap entry; they are swept
        assert len(s._index.heap) <= 2 * 10 + 1024
        assert s.stats()["disk.items_read"] == 5000


def test_item_larger_than_capacity_is_refused(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "s", 4 * UNIT, IDENT) as s:
        assert not s.put(CP, 1, 0, b"x" * (4 * UNIT), 1.0)
        assert s.put(CP, 2, 0, b"x" * (4 * UNIT - HEADER_BYTES), 1.0)
        assert s.flush(10) and s.has(CP, 2)
        assert s.stats()["disk.queue_drops"] == 1
        assert s.stats()["disk.bytes"] == 4 * UNIT


def test_capacity_is_never_exceeded(tmp_path: Path) -> None:
    cap = 40 * UNIT
    with DiskStore(tmp_path / "s", cap, IDENT) as s:
        for k in range(1, 200):
            s.put(KV if k % 3 else CP, k, k - 1 if k % 3 else k, payload_for(k, (k * 977) % 20000), k)
            assert s.stats()["disk.bytes"] <= cap
        assert s.flush(30)
        st = s.stats()
        assert st["disk.bytes"] <= cap
        assert st["disk.bytes"] == sum(accounted_bytes(len(s.read(*i) or b"")) for i in s.items())
