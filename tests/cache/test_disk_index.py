"""DiskIndex (``cache/disk_index.py``): GDSF over leaves, the one eviction rule of the disk
store and the simulator's store; a queued item's parent is protected; bytes reserved for a
write count; misuse is a typed error."""

from __future__ import annotations

import pytest

from deltaserve.cache.disk_format import ItemKind
from deltaserve.cache.disk_index import DiskEntry, DiskIndex, DiskIndexError
from deltaserve.cache.types import DiskItemKind

KV, CP = ItemKind.KV, ItemKind.CHECKPOINT


def _add(
    ix: DiskIndex, kind: ItemKind, key: int, parent: int, cost: float = 0.0, size: int = 10
) -> DiskEntry:
    """What a store does for one item: register its parent, make room, store it."""
    ix.depend(parent)
    victims, fits = ix.make_room(size)
    assert fits and not victims, "these tests make room explicitly"
    e = DiskEntry(kind, key, parent, size, size, cost)
    ix.add(e)
    ix.check_integrity()
    return e


def _evict(ix: DiskIndex, size: int) -> list[tuple[str, int]]:
    victims, fits = ix.make_room(size)
    assert fits
    ix.check_integrity()
    return [(v.kind.name, v.key) for v in victims]


def test_victims_go_by_value_per_byte_leaves_first() -> None:
    ix = DiskIndex(70)
    _add(ix, KV, 1, 0)
    _add(ix, KV, 2, 1)
    _add(ix, CP, 2, 2, 300.0)  # its own path is 30 bytes: 10 per byte
    _add(ix, KV, 11, 0)
    _add(ix, CP, 11, 11, 60.0)  # 20 bytes: 3 per byte
    _add(ix, KV, 21, 0)  # nothing on or below it: worth L
    assert ix.used == 60
    assert _evict(ix, 20) == [("KV", 21)] and ix.inflation == 0.0
    # the cheapest checkpoint next, L rising to its H; then its bare KV block, worth L
    assert _evict(ix, 30) == [("CHECKPOINT", 11)] and ix.inflation == pytest.approx(3.0)
    assert _evict(ix, 40) == [("KV", 11)] and ix.inflation == pytest.approx(3.0)
    # a chain goes from its leaf up, each block once nothing depends on it
    assert _evict(ix, 70) == [("CHECKPOINT", 2), ("KV", 2), ("KV", 1)]
    assert ix.inflation == pytest.approx(10.0) and len(ix) == 0 and ix.used == 0


def test_a_read_raises_an_items_rank() -> None:
    ix = DiskIndex(40)
    a = _add(ix, CP, 1, 0, 30.0)
    _add(ix, CP, 2, 0, 30.0)
    ix.touch(a)
    assert a.freq == 2
    assert _evict(ix, 30) == [("CHECKPOINT", 2)]


def test_a_fork_above_a_checkpoint_reprices_it_when_popped() -> None:
    ix = DiskIndex(100)
    _add(ix, KV, 1, 0)
    _add(ix, KV, 2, 1)
    _add(ix, CP, 2, 2, 60.0)  # 60 over its 30-byte path: H = 2
    _add(ix, KV, 9, 0)
    _add(ix, CP, 9, 9, 50.0)  # 50 over 20 bytes: H = 2.5
    _add(ix, KV, 3, 1)  # a fork at block 1: checkpoint 2 keeps only 20 bytes useful, H = 3
    _add(ix, CP, 3, 3, 1000.0)
    assert ix.used == 70
    assert _evict(ix, 40) == [("CHECKPOINT", 9)] and ix.inflation == pytest.approx(2.5)


def test_a_queued_items_parent_is_never_a_victim() -> None:
    ix = DiskIndex(20)
    _add(ix, KV, 1, 0)
    ix.depend(1)  # a checkpoint on block 1 is queued
    assert ix.dependents(1) == 1
    assert ix.make_room(20) == ([], False)
    ix.check_integrity()
    ix.undepend(1)  # it never lands: block 1 is a leaf again
    assert ix.dependents(1) == 0
    assert _evict(ix, 20) == [("KV", 1)]


def test_reserved_bytes_count_until_the_item_is_added() -> None:
    ix = DiskIndex(30)
    _add(ix, KV, 1, 0)
    ix.depend(1)
    assert ix.make_room(20) == ([], True)
    ix.reserve(20)  # the checkpoint is being written
    assert ix.used == 30 and ix.stats().reserved == 20
    ix.check_integrity()
    assert ix.make_room(10) == ([], False)  # nothing can go: block 1 is held by the write
    ix.release(20)
    ix.add(DiskEntry(CP, 1, 1, 20, 20, 5.0))
    assert ix.used == 30 and ix.stats().reserved == 0 and ix.dependents(1) == 1
    ix.check_integrity()


def test_an_item_larger_than_the_capacity_evicts_nothing() -> None:
    ix = DiskIndex(20)
    _add(ix, KV, 1, 0)
    assert ix.make_room(21) == ([], False) and len(ix) == 1


def test_load_counts_dependencies_first_and_make_room_trims_the_excess() -> None:
    ix = DiskIndex(30)
    entries = [
        DiskEntry(CP, 2, 2, 10, 10, 40.0, freq=3),  # listed before its parent
        DiskEntry(KV, 2, 1, 10, 10, 0.0),
        DiskEntry(KV, 1, 0, 10, 10, 0.0),
        DiskEntry(KV, 7, 0, 10, 10, 0.0),
        DiskEntry(CP, 8, 0, 10, 10, 5.0),
    ]
    ix.load(entries, 1.5)
    assert ix.used == 50 and ix.inflation == 1.5
    ix.check_integrity()
    # the bare KV leaf first (worth L), then the checkpoint worth 1.5 + 5/10
    assert _evict(ix, 0) == [("KV", 7), ("CHECKPOINT", 8)] and ix.inflation == pytest.approx(2.0)
    with pytest.raises(DiskIndexError, match="empty index only"):
        ix.load([], 0.0)


def test_kinds_of_either_enum_share_one_index() -> None:
    ix = DiskIndex(30)
    _add(ix, DiskItemKind.KV, 1, 0)  # the simulator's kinds
    _add(ix, CP, 1, 1, 10.0)  # the store's
    assert (KV, 1) in ix and ix.get(DiskItemKind.CHECKPOINT, 1) is not None
    assert ix.dependents(1) == 1 and _evict(ix, 30) == [("CHECKPOINT", 1), ("KV", 1)]


def test_stale_heap_entries_are_swept() -> None:
    ix = DiskIndex(1 << 20)
    entries = [_add(ix, CP, k, 0, 1.0) for k in range(1, 11)]
    for _ in range(500):
        for e in entries:
            ix.touch(e)
    assert len(ix.heap) <= 2 * 10 + 1024
    ix.check_integrity()


def test_misuse_is_a_typed_error() -> None:
    ix = DiskIndex(100)
    with pytest.raises(DiskIndexError, match="call depend first"):
        ix.add(DiskEntry(KV, 2, 1, 10, 10, 0.0))
    _add(ix, KV, 1, 0)
    with pytest.raises(DiskIndexError, match="already stored"):
        ix.add(DiskEntry(KV, 1, 0, 10, 10, 0.0))
    with pytest.raises(DiskIndexError, match="cannot release 5 bytes, 0 reserved"):
        ix.release(5)
    with pytest.raises(DiskIndexError, match="must be > 0"):
        DiskIndex(0)
    ix.check_integrity()  # the refused calls changed nothing


def test_check_integrity_catches_a_leaf_missing_from_the_heap() -> None:
    ix = DiskIndex(100)
    _add(ix, KV, 1, 0)
    ix.heap.clear()
    with pytest.raises(AssertionError, match="not in the heap"):
        ix.check_integrity()
