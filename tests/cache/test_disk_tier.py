"""The disk tier's bookkeeping (``cache/disk_tier.py``) with a store that lives in a dict.

A "runner" copies each planned save's *content* (what the block or slot holds: its key) into
the store, and each disk load's bytes back; a "restart" is a fresh manager over the same
store. What is checked: a restarted manager serves a hit from disk with exactly the bytes
written for those keys into exactly the request's blocks and live slot; a missing or damaged
item shortens the hit (never a wrong one); write-back keeps what the device drops;
``check_integrity`` holds throughout.
"""

from __future__ import annotations

import time
from typing import Any

from deltaserve.cache import CacheManager, CacheManagerConfig, CheckpointGranularity, SeqCache, StepItem
from deltaserve.cache.disk_tier import DiskTier
from deltaserve.cache.types import DiskItemKind, StepPlan, TransferKind

BS, KV_BYTES, CKPT_BYTES = 16, 32, 48


class DictStore:
    """The store's interface over a dict: bytes by (kind, key); ``damaged`` keys read as None."""

    def __init__(self) -> None:
        self.items: dict[tuple[DiskItemKind, int], bytes] = {}
        self.parents: dict[tuple[DiskItemKind, int], int] = {}
        self.damaged: set[tuple[DiskItemKind, int]] = set()
        self.reads = 0

    def has(self, kind: DiskItemKind, key: int) -> bool:
        return (kind, key) in self.items

    def queued(self, kind: DiskItemKind, key: int) -> bool:
        return False

    def put(self, kind: DiskItemKind, key: int, parent: int, payload: bytes, cost: float) -> bool:
        if (kind, key) in self.items:
            return False
        self.items[kind, key] = payload
        self.parents[kind, key] = parent
        return True

    def read(self, kind: DiskItemKind, key: int) -> bytes | None:
        self.reads += 1
        if (kind, key) in self.damaged:
            del self.items[kind, key]  # a damaged item is forgotten, as the real store does
            self.damaged.discard((kind, key))
            return None
        return self.items.get((kind, key))

    def stats(self) -> dict[str, int | float]:
        return {"disk.items": len(self.items)}

    def close(self) -> None:
        pass


def content(kind: DiskItemKind, key: int) -> bytes:
    """What a block or checkpoint of ``key`` holds, as the runner would copy it out."""
    size = KV_BYTES if kind is DiskItemKind.KV else CKPT_BYTES
    return (key.to_bytes(16, "little") * 4)[:size]


def manager(store: DictStore, **kw: Any) -> CacheManager:
    cfg: dict[str, Any] = dict(
        block_size=BS, num_kv_blocks=40, num_live_slots=2, num_checkpoint_slots=4,
        checkpoint_bytes=CKPT_BYTES, kv_block_bytes=KV_BYTES,
        checkpoint_granularity=CheckpointGranularity.CHUNK,
    )  # fmt: skip
    # chunk granularity: the boundaries below are multiples of 64 (what is tested does not depend on it;
    # test_manager.py covers block granularity)
    cfg.update(kw)
    cm = CacheManager(CacheManagerConfig(**cfg))
    cm.attach_disk(
        DiskTier(
            store,
            block_size=BS,
            unit_blocks=cm.unit // BS,
            kv_block_bytes=KV_BYTES,
            checkpoint_bytes=CKPT_BYTES,
        )
    )
    return cm


class Runner:
    """Plays the engine's copies: saves copy contents out, disk loads land in ``blocks``/``slots``."""

    def __init__(self, cm: CacheManager, store: DictStore) -> None:
        self.cm, self.store = cm, store
        self.blocks: dict[int, bytes] = {}
        self.slots: dict[int, bytes] = {}

    def run(self, plan: StepPlan) -> None:
        for s in plan.disk_saves:
            self.store.put(s.kind, s.key, s.parent, content(s.kind, s.key), s.cost)
        for t in plan.loads:
            assert t.kind.from_disk and t.payload is not None
            (self.blocks if t.kind is TransferKind.DISK_KV_LOAD else self.slots)[t.dst] = t.payload
        self.cm.land_transfers(plan)
        self.cm.commit_step(plan)
        self.cm.check_integrity()

    def step(self, items: list[StepItem]) -> None:
        self.run(self.cm.plan_step(items))


def serve(r: Runner, rid: str, toks: list[int]) -> None:
    """Admit (no disk), prefill whole, finish; then a step that writes what it published."""
    seq = r.cm.admit(rid, toks, b"s")
    assert seq is not None
    r.cm.record_query(len(toks), seq.num_cached_tokens, seq)
    assert r.cm.allocate(seq, len(toks))
    r.step([StepItem(seq, toks, seq.num_cached_tokens, len(toks), False)])
    r.cm.free(seq)
    r.step([])


def admit_from_disk(r: Runner, rid: str, toks: list[int]) -> SeqCache:
    cm = r.cm
    match = cm.match(toks, b"s", [], key=rid)
    fetch = cm.disk_fetch(rid, toks, match)
    assert fetch is not None
    deadline = time.monotonic() + 10
    while not fetch.done:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    seq = cm.admit(rid, toks, b"s", match=match, disk=fetch)
    assert seq is not None
    return seq


def test_a_restarted_manager_serves_the_hit_from_disk_into_the_requests_blocks() -> None:
    store = DictStore()
    first = Runner(manager(store), store)
    convo = list(range(100))  # 6 full blocks; the tail checkpoint at 64 tokens (4 blocks)
    serve(first, "a", convo)
    hashes = first.cm.extend_hashes(convo, b"s", [])
    for i in range(4):
        assert store.has(DiskItemKind.KV, hashes[i])
    assert store.parents[DiskItemKind.KV, hashes[1]] == hashes[0]
    assert store.has(DiskItemKind.CHECKPOINT, hashes[3])

    second = Runner(manager(store), store)  # a restart: an empty tree over the same store
    turn2 = convo + [9, 9, 9]
    assert second.cm.match(turn2, b"s", []).hit_blocks == 0
    seq = admit_from_disk(second, "b", turn2)
    assert seq.num_cached_tokens == 64 and seq.disk_hit_tokens == 64
    assert [t.kind for t in seq.loads] == [TransferKind.DISK_KV_LOAD] * 4 + [TransferKind.DISK_STATE_LOAD]
    assert second.cm.stage_loads(seq)
    second.step([])
    assert not seq.loads
    for i in range(4):  # the disk's bytes, in the blocks the request's table names
        assert second.blocks[seq.block_table[i]] == content(DiskItemKind.KV, hashes[i])
    assert second.slots[seq.state_slot] == content(DiskItemKind.CHECKPOINT, hashes[3])
    second.cm.record_query(len(turn2), seq.num_cached_tokens, seq)
    assert second.cm.allocate(seq, len(turn2))
    second.step([StepItem(seq, turn2, 64, len(turn2), False)])
    assert second.cm.match(turn2, b"s", []).path[3].block_id == seq.block_table[3]  # published
    second.cm.free(seq)
    stats = second.cm.stats()
    assert stats["prefix_cache.hit_tokens_disk"] == 64
    assert stats["disk.kv_loaded_blocks"] == 4 and stats["disk.checkpoints_loaded"] == 1
    second.cm.check_integrity()


def test_a_damaged_checkpoint_falls_back_to_a_shallower_one_never_a_wrong_hit() -> None:
    store = DictStore()
    first = Runner(manager(store, checkpoint_interval=64), store)
    convo = list(range(150))  # checkpoints at 64 and 128
    serve(first, "a", convo)
    hashes = first.cm.extend_hashes(convo, b"s", [])
    assert store.has(DiskItemKind.CHECKPOINT, hashes[7]) and store.has(DiskItemKind.CHECKPOINT, hashes[3])
    store.damaged.add((DiskItemKind.CHECKPOINT, hashes[7]))
    second = Runner(manager(store), store)
    seq = admit_from_disk(second, "b", convo + [1])
    assert seq.num_cached_tokens == 64  # the deeper one failed its read: the next one serves
    assert not store.has(DiskItemKind.CHECKPOINT, hashes[7])
    second.cm.free(seq, publish_output=False)
    second.cm.check_integrity()


def test_a_missing_kv_block_leaves_no_disk_hit_past_it() -> None:
    store = DictStore()
    first = Runner(manager(store), store)
    convo = list(range(100))
    serve(first, "a", convo)
    hashes = first.cm.extend_hashes(convo, b"s", [])
    del store.items[DiskItemKind.KV, hashes[2]]  # deleted behind the store's back
    second = Runner(manager(store), store)
    match = second.cm.match(convo + [1], b"s", [], key="b")
    assert second.cm.disk_fetch("b", convo + [1], match) is None  # the probe sees the gap
    store.items[DiskItemKind.KV, hashes[2]] = content(DiskItemKind.KV, hashes[2])
    store.damaged.add((DiskItemKind.KV, hashes[2]))  # listed, but its read fails
    seq = admit_from_disk(second, "c", convo + [1])
    assert seq.num_cached_tokens == 0 and not seq.loads
    second.cm.free(seq, publish_output=False)
    second.cm.check_integrity()


def test_write_back_keeps_what_the_device_drops_when_write_through_was_skipped() -> None:
    store = DictStore()
    cm = manager(store, num_kv_blocks=10, num_checkpoint_slots=1)
    assert cm.disk is not None
    cm.disk.rate = 1.0  # one byte per second: write-through never has the budget
    cm.disk._allowance = 0.0
    r = Runner(cm, store)
    convo = list(range(100))
    serve(r, "a", convo)
    hashes = cm.extend_hashes(convo, b"s", [])
    assert not store.has(DiskItemKind.CHECKPOINT, hashes[3])
    assert cm.disk.counters["disk.saves_skipped_rate"] >= 1
    cm.disk.rate = None  # the budget is back: the eviction below writes it back
    serve(r, "b", [7] * 150)  # fills the device: the conversation is dropped
    assert cm.match(convo + [1], b"s", []).hit_blocks == 0
    assert store.has(DiskItemKind.CHECKPOINT, hashes[3])
    assert all(store.has(DiskItemKind.KV, hashes[i]) for i in range(4))
    assert cm.disk.counters["disk.write_backs"] >= 1
    seq = admit_from_disk(r, "c", convo + [1])
    assert seq.num_cached_tokens == 64
    cm.free(seq, publish_output=False)
    cm.check_integrity()


def test_a_request_gone_before_its_read_is_used_frees_its_buffers() -> None:
    store = DictStore()
    first = Runner(manager(store), store)
    convo = list(range(100))
    serve(first, "a", convo)
    second = manager(store)
    assert second.disk is not None
    match = second.match(convo + [1], b"s", [], key="b")
    fetch = second.disk_fetch("b", convo + [1], match)
    assert fetch is not None and second.disk.buffered > 0
    second.forget("b")
    assert second.disk.buffered == 0 and not second.disk.fetches


def test_a_store_that_lists_what_it_cannot_read_is_tried_once_per_request() -> None:
    """A read that finds nothing usable while the store still lists the items: the request
    goes on without the disk instead of being read again and again (a livelock)."""
    store = DictStore()
    first = Runner(manager(store), store)
    convo = list(range(100))
    serve(first, "a", convo)
    store.read = lambda kind, key: None  # type: ignore[method-assign]
    cm = manager(store)
    assert cm.disk is not None
    prompt = convo + [1]
    match = cm.match(prompt, b"s", [], key="b")
    fetch = cm.disk_fetch("b", prompt, match)
    assert fetch is not None and fetch.future is not None
    fetch.future.result(timeout=10)
    assert fetch.done and fetch.end_block == 0
    assert cm.disk_fetch("b", prompt, match) is None  # given up for this request
    cm.forget("b")
    assert cm.disk_fetch("b", prompt, match) is not None  # a new request of that id may try again
