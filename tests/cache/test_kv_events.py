"""Cache events: the stream a real engine publishes rebuilds its cache exactly, per tier.

A subscriber (``cluster/kv_index.py``) on 127.0.0.1 follows an engine with small device pools
(evictions), a host tier and a disk tier, through a restart on the same disk; after every
step the index rebuilt from the events equals ``contents`` of the cache (KV blocks and
checkpoints per medium). The wire decodes with vLLM-shaped msgspec structs written here;
replay fills a gap; a subscriber that never reads does not slow the engine.
"""

from __future__ import annotations

import random
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from deltaserve.cache.disk_store import DiskStore
from deltaserve.cache.event_collector import contents
from deltaserve.cache.kv_events import MEDIA, decode_batch, hash_int
from deltaserve.cache.layered_store import LayeredStore
from deltaserve.cache.remote_store import RemoteStore
from deltaserve.cluster.kv_index import KVEventSubscriber
from deltaserve.engine.core.engine_core import EngineCore
from tests.engine.conftest import greedy
from tests.engine.test_prefix_cache import rand_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _events(**extra: Any) -> tuple[dict[str, Any], str, str]:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    dotted = {
        "kv_events.enable_kv_cache_events": True,
        "kv_events.endpoint": pub.replace("127.0.0.1", "*"),
        "kv_events.replay_endpoint": replay,
    }
    dotted.update(extra)
    return dotted, pub, replay


def _pressured(core_factory: Any, tmp_path: Path, events: dict[str, Any]) -> EngineCore:
    probe = core_factory()
    slot, block = probe.cache.config.checkpoint_bytes, probe.capacity.kv_block_bytes
    probe.close()
    return core_factory(**{
        "cache.checkpoint_pool_bytes": 2 * slot,
        "cache.num_kv_blocks": 48,
        "cache.checkpoint_interval": 0,
        "cache.host_kv_cache_bytes": 40 * block,
        "cache.host_checkpoint_pool_bytes": 3 * slot,
        "cache.disk_path": str(tmp_path / "store"),
        "cache.disk_write_bytes_per_s": None,
        "cache.disk_bytes": 3 * slot,  # a few checkpoints with their KV: the disk evicts too
        **events,
    })  # fmt: skip


def _settle(core: EngineCore, sub: KVEventSubscriber) -> None:
    """Publish what the disk writer indexed since the step, and read the stream up to it."""
    flight = core.overlap.flight if core.overlap is not None else None
    if flight is not None:  # async scheduling: the next step's disk saves run on the worker
        flight.future.result()
    if core.disk is not None:
        for store in _stores(core):
            store.flush(60.0)
    assert core.kv_events is not None
    core.kv_events.end_step()
    target = core.kv_events.publisher._next_seq - 1  # the last batch queued
    deadline = time.monotonic() + 10.0
    while sub.last_seq < target and time.monotonic() < deadline:
        if not sub.poll(0.05):
            sub.catch_up()  # (zmq's slow joiner: the first batches went before we subscribed)
    assert sub.last_seq == target, f"subscriber at {sub.last_seq}, publisher at {target}"


def _stores(core: EngineCore) -> list[Any]:
    """The tier's stores: a disk store, a remote store, or both (``LayeredStore``)."""
    if core.disk is None:
        return []
    store = core.disk.store
    return [store.disk, store.remote] if isinstance(store, LayeredStore) else [store]


def _check(core: EngineCore, sub: KVEventSubscriber, where: str) -> None:
    stores = _stores(core)
    disk = [i for s in stores if isinstance(s, DiskStore) for i in s.items()]
    remote = [i for s in stores if isinstance(s, RemoteStore) for i in s.items()]
    want = contents(core.cache.tree, disk, remote)
    assert not sub.stale
    for m in MEDIA:
        assert sub.index.blocks[m] == want.blocks[m], f"{where}: {m} blocks differ"
        assert sub.index.checkpoints[m] == want.checkpoints[m], f"{where}: {m} checkpoints differ"


def _serve_checked(
    core: EngineCore, sub: KVEventSubscriber, prompts: list[list[int]], turn: int
) -> list[list[int]]:
    outs: list[list[int]] = []
    for i, p in enumerate(prompts):  # one after another: each evicts the others
        req = core.make_request(p, greedy(6))
        core.add_request(req)
        toks: list[int] = []
        step = 0
        while core.has_work():
            for o in core.step():
                toks += o.token_ids
            core.check_integrity()
            _settle(core, sub)
            _check(core, sub, f"turn {turn} prompt {i} step {step}")
            step += 1
        outs.append(toks)
    return outs


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
def test_the_event_stream_rebuilds_every_tier_across_evictions_and_a_restart(
    core_factory: Any, tmp_path: Path, overlap: bool
) -> None:
    events, pub, replay = _events(**{"engine.async_scheduling": overlap})
    rng = random.Random(5)
    convs = [rand_tokens(rng, 140 + 25 * i) for i in range(4)]
    seen: Counter[tuple[str, str | None]] = Counter()
    for life in range(2):  # the second engine restarts on the first one's disk
        sub = KVEventSubscriber(pub, replay)
        apply = sub.index.apply

        def counting(event: Any, apply: Any = apply) -> None:
            seen[(type(event).__name__, getattr(event, "medium", None))] += 1
            apply(event)

        sub.index.apply = counting  # type: ignore[method-assign]
        try:
            core = _pressured(core_factory, tmp_path, events)
            try:
                _settle(core, sub)
                if life == 1:  # a restart: cleared, then what the disk holds
                    assert sub.index.blocks["DISK"] and not sub.index.blocks["GPU"]
                _check(core, sub, f"life {life} start")
                for turn in range(2):
                    outs = _serve_checked(core, sub, convs, turn)
                    convs = [c + o + rand_tokens(rng, 24) for c, o in zip(convs, outs, strict=True)]
                s = core.stats()
                assert s["kv.evicted_blocks"] > 0 and s["host.kv_demoted_blocks"] > 0
                assert s["disk.evicted_items"] > 0
                assert s["kv_events.published"] > 0 and s["kv_events.dropped"] == 0
            finally:
                core.close()
            assert sub.counters["lost"] == 0
        finally:
            sub.close()
    assert seen[("AllBlocksCleared", None)] == 2
    for m in ("GPU", "CPU", "DISK"):  # every kind of change, in every tier (no remote one here)
        for kind in ("BlockStored", "BlockRemoved", "CheckpointStored", "CheckpointRemoved"):
            assert seen[(kind, m)] > 0, f"no {kind} on {m}: {dict(seen)}"


# ---------------------------------------------------------------- the wire, decoded as vLLM does
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VllmEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(VllmEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(VllmEvent):
    pass


class CheckpointStored(VllmEvent):
    block_hash: bytes
    medium: str | None


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared | CheckpointStored]


# newer vLLM's layout: each event a map of named fields with its tag under "type"
class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class MapCheckpointStored(MapEvent, tag="CheckpointStored"):
    block_hash: bytes
    medium: str | None


class MapBatch(EventBatch):
    events: list[MapBlockStored | MapCheckpointStored]


@pytest.mark.parametrize("layout", ["array", "map"])
def test_the_wire_is_vllms_and_replay_resends_from_a_sequence_number(core_factory: Any, layout: str) -> None:
    events, pub, replay = _events(**{"kv_events.layout": layout})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        core = core_factory(**events)
        try:
            time.sleep(0.3)  # the SUB's subscription reaches the PUB (zmq's slow joiner)
            prompt = rand_tokens(random.Random(1), 40)
            core.add_request(core.make_request(prompt, greedy(2)))
            while core.has_work():
                core.step()
            decoder = msgspec.msgpack.Decoder(KVEventBatch if layout == "array" else MapBatch)
            frames: list[list[bytes]] = []
            while sub.poll(2000):
                frames.append(sub.recv_multipart())
                if any(
                    isinstance(e, BlockStored | MapBlockStored) for e in decoder.decode(frames[-1][2]).events
                ):
                    break
            assert frames, "nothing published"
            topic, seq, payload = frames[-1]
            assert topic == b"" and len(seq) == 8
            batch = decoder.decode(payload)
            assert batch.data_parallel_rank == 0 and batch.ts > 0
            stored = [e for e in batch.events if isinstance(e, BlockStored | MapBlockStored)]
            assert decode_batch(payload)[0].events  # ours reads either layout
            assert (
                stored[0].medium == "GPU"
                and stored[0].block_size == 16
                and stored[0].parent_block_hash is None
            )
            assert stored[0].token_ids == prompt[: 16 * len(stored[0].block_hashes)]
            assert all(len(h) == 16 for h in stored[0].block_hashes)
            root = core.cache.tree.root
            assert hash_int(stored[0].block_hashes[0]) in root.children

            # replay from the batch before: the same bytes, then the end marker
            req = ctx.socket(zmq.DEALER)  # (a DEALER takes the many replies; REQ expects one)
            req.connect(replay)
            start = int.from_bytes(seq, "big") - 1
            req.send_multipart((b"", start.to_bytes(8, "big")))
            got: list[tuple[int, bytes]] = []
            while req.poll(2000):
                _, s, p = req.recv_multipart()
                if s == (-1).to_bytes(8, "big", signed=True):
                    break
                got.append((int.from_bytes(s, "big"), p))
            req.close(linger=0)
            assert got[0][0] == start and (int.from_bytes(seq, "big"), payload) in got
        finally:
            core.close()
    finally:
        sub.close(linger=0)
        ctx.term()
