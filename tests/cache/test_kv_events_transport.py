"""Cache events' transport: gaps are replayed, a lost batch is resynced, a subscriber that
never reads (or a full queue) never stalls a step, unknown tags are skipped, config errors are
exact. Sockets on 127.0.0.1 free ports, closed in each test."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from deltaserve.cache import kv_events
from deltaserve.cache.event_collector import contents
from deltaserve.cache.kv_events import BlockStored, KVEventBatch, decode_batch, hash_bytes
from deltaserve.cluster.kv_index import KVEventSubscriber
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.config_kv_events import KVEventsConfig
from deltaserve.engine.core import kv_event_publisher
from deltaserve.engine.core.kv_event_publisher import KVEventPublisher
from deltaserve.engine.errors import ConfigError
from tests.engine.conftest import greedy
from tests.engine.test_prefix_cache import rand_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(**extra: Any) -> KVEventsConfig:
    fields: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{free_port()}".replace("127.0.0.1", "*"),
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    fields.update(extra)
    return KVEventsConfig(**fields)


def _local(endpoint: str) -> str:
    return endpoint.replace("*", "127.0.0.1")


def _stored(key: int) -> BlockStored:
    return BlockStored([hash_bytes(key)], None, [1] * 16, 16, None, "GPU")


def _drain(sub: KVEventSubscriber, target: int) -> None:
    deadline = time.monotonic() + 10.0
    while sub.last_seq < target and time.monotonic() < deadline:
        if not sub.poll(0.05):
            sub.catch_up()


def test_a_gap_in_the_sequence_is_filled_from_the_replay_socket() -> None:
    cfg = _config()
    pub = KVEventPublisher(cfg)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)  # what the wire carried, to hand the subscriber with a hole in it
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(_local(cfg.endpoint))
    sub = KVEventSubscriber(_local(cfg.endpoint), cfg.replay_endpoint)
    try:
        time.sleep(0.3)  # both subscriptions reach the PUB socket
        for key in range(1, 6):
            assert pub.publish([_stored(key)])
        frames = []
        while len(frames) < 5 and raw.poll(2000):
            frames.append(raw.recv_multipart())
        assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1, 2, 3, 4]
        assert sub.receive(0, frames[0][2]) == 1
        assert sub.receive(3, frames[3][2]) == 3  # 1 and 2 replayed first, then 3
        assert sub.index.blocks["GPU"] == {1, 2, 3, 4} and sub.last_seq == 3
        assert sub.counters["gaps"] == 1 and sub.counters["replayed"] == 2 and not sub.stale
        assert sub.receive(4, frames[4][2]) == 1
        # a subscriber that caught up by replay skips those batches when they arrive live
        late = KVEventSubscriber(_local(cfg.endpoint), cfg.replay_endpoint)
        try:
            assert late.receive(0, frames[0][2]) == 1 and late.catch_up() == 4
            assert [late.receive(i, frames[i][2]) for i in (1, 2, 3, 4)] == [0, 0, 0, 0]
            assert late.index.blocks["GPU"] == {1, 2, 3, 4, 5} and late.counters["batches"] == 5
            # a restarted publisher on the same endpoints: its live numbers go back; the
            # subscriber starts over and replays the new stream's batches it missed
            pub.close()
            pub = KVEventPublisher(cfg)
            batches = ([kv_events.AllBlocksCleared(), _stored(9)], [_stored(10)], [_stored(11)])
            for events in batches:
                assert pub.publish(events)
            deadline = time.monotonic() + 5.0
            while pub.counters["kv_events.published"] < 4 and time.monotonic() < deadline:
                time.sleep(0.01)  # (sent, so in the replay buffer)
            third = kv_events.encode_batch(KVEventBatch(0.0, batches[2], 0))
            assert late.receive(2, third) == 3  # (batches 0 and 1 went before it reconnected)
            assert late.counters["restarts"] == 1 and not late.stale
            assert late.index.blocks["GPU"] == {9, 10, 11}
        finally:
            late.close()
    finally:
        sub.close()
        raw.close(linger=0)
        ctx.term()
        pub.close()


def test_a_gap_no_replay_can_fill_marks_the_index_stale_until_a_resync() -> None:
    cfg = _config(replay_endpoint=None)
    pub = KVEventPublisher(cfg)
    sub = KVEventSubscriber(_local(cfg.endpoint))
    try:
        time.sleep(0.3)
        payloads = [kv_events.encode_batch(KVEventBatch(0.0, [_stored(k)], 0)) for k in range(3)]
        sub.receive(0, payloads[0])
        sub.receive(2, payloads[2])
        assert sub.stale and sub.counters["lost"] == 1
        resync = KVEventBatch(0.0, [kv_events.AllBlocksCleared(), _stored(7)], 0)
        sub.receive(3, kv_events.encode_batch(resync))
        assert not sub.stale and sub.index.blocks["GPU"] == {7}
        # a restarted publisher starts again at 0 with a clean batch: a new stream
        sub.receive(0, kv_events.encode_batch(KVEventBatch(0.0, [kv_events.AllBlocksCleared()], 0)))
        assert sub.last_seq == 0 and sub.index.all_blocks() == set()
    finally:
        sub.close()
        pub.close()


class _Future(msgspec.Struct, array_like=True, tag="BlockMoved"):
    block_hashes: list[bytes]


def test_unknown_event_tags_are_skipped_not_fatal() -> None:
    class Batch(msgspec.Struct, array_like=True):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    payload = msgspec.msgpack.encode(Batch(1.5, [_stored(5), _Future([b"x" * 16]), _stored(6)], 0))
    batch, skipped = decode_batch(payload)
    assert skipped == 1 and [type(e) for e in batch.events] == [BlockStored, BlockStored]
    # the map layout (newer vLLM's), with a field this decoder does not know: ignored
    stored = {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "kv_cache_spec_kind": "full_attention",
    }
    maps = msgspec.msgpack.encode(Batch(2.0, [stored, {"type": "BlockMoved", "block_hashes": []}], 0))
    batch, skipped = decode_batch(maps)
    assert skipped == 1 and batch.events == [BlockStored([7], None, [], 16, None, "CPU")]
    with pytest.raises(msgspec.ValidationError):  # a known tag with bad fields still fails
        decode_batch(msgspec.msgpack.encode(Batch(1.5, [["BlockStored", "not a list"]], 0)))


def test_a_subscriber_that_never_reads_and_a_full_queue_never_stall_a_step(
    core_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publisher thread is stuck (its encode sleeps) with a one-batch queue, and a
    subscriber is connected that never reads: steps go on at their pace; batches are dropped,
    counted, and once the thread is back a resync makes a fresh subscriber's index exact."""
    cfg = _config(max_queue_size=1, hwm=1)
    stuck = {"on": True}
    encode = kv_event_publisher.encode_batch

    def slow_encode(batch: KVEventBatch, layout: str) -> bytes:
        while stuck["on"]:
            time.sleep(0.01)
        return encode(batch, layout)

    monkeypatch.setattr(kv_event_publisher, "encode_batch", slow_encode)
    ctx = zmq.Context()
    dead = ctx.socket(zmq.SUB)  # connected, subscribed, never read
    dead.setsockopt(zmq.RCVHWM, 1)
    dead.setsockopt(zmq.SUBSCRIBE, b"")
    dead.connect(_local(cfg.endpoint))
    dotted = {f"kv_events.{k}": v for k, v in msgspec.structs.asdict(cfg).items() if v is not None}
    core = core_factory(**dotted)
    sub = None
    try:
        rng = random.Random(2)
        slowest = 0.0
        for _ in range(3):
            core.add_request(core.make_request(rand_tokens(rng, 100), greedy(4)))
            while core.has_work():
                t0 = time.perf_counter()
                core.step()
                slowest = max(slowest, time.perf_counter() - t0)
        # the thread has been stuck all along: a blocking put would have hung the first step
        assert slowest < 5.0
        s = core.stats()
        assert s["kv_events.dropped"] > 0 and s["kv_events.batches_dropped"] > 0
        assert s["kv_events.published"] == 0
        stuck["on"] = False
        sub = KVEventSubscriber(_local(cfg.endpoint), cfg.replay_endpoint)
        core.add_request(core.make_request(rand_tokens(rng, 40), greedy(2)))
        while core.has_work():
            core.step()
        assert core.kv_events is not None
        for _ in range(3):  # until a batch is taken: the resync goes with it
            core.kv_events.end_step()
            time.sleep(0.1)
        _drain(sub, core.kv_events.publisher._next_seq - 1)
        want = contents(core.cache.tree)
        assert not sub.stale
        assert sub.index.blocks["GPU"] == want.blocks["GPU"]
        assert sub.index.checkpoints["GPU"] == want.checkpoints["GPU"]
    finally:
        stuck["on"] = False
        core.close()
        if sub is not None:
            sub.close()
        dead.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    ("dotted", "message"),
    [
        (
            {"kv_events.endpoint": "http://127.0.0.1:5557"},
            "kv_events.endpoint = 'http://127.0.0.1:5557': expected a ZeroMQ endpoint: "
            "tcp://HOST:PORT, ipc://PATH or inproc://NAME",
        ),
        (
            {"kv_events.enable_kv_cache_events": True, "kv_events.endpoint": "tcp://*:5557",
             "kv_events.replay_endpoint": "tcp://*:5557"},
            "kv_events.replay_endpoint = 'tcp://*:5557': must differ from kv_events.endpoint",
        ),
        (
            {"kv_events.publisher": "zmq"},
            "kv_events.publisher = 'zmq': needs kv_events.enable_kv_cache_events = true (nothing is collected)",
        ),
        ({"kv_events.publisher": "kafka"}, "kv_events.publisher = 'kafka': expected one of null, zmq"),
        ({"kv_events.buffer_steps": 0}, "kv_events.buffer_steps = 0: Expected `int` >= 1"),
        ({"kv_events.hwm": -1}, "kv_events.hwm = -1: Expected `int` >= 0"),
        ({"kv_events.endpoints": "tcp://*:1"}, "kv_events.endpoints: unknown key"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key_and_the_value(dotted: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        EngineConfig.load(None, dotted)
    assert str(e.value) == message


def test_an_endpoint_in_use_is_a_config_error_at_start_before_the_disk_is_locked(
    core_factory: Any, tmp_path: Path
) -> None:
    disk = {"cache.disk_path": str(tmp_path / "store")}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as e:  # the engine does not start
            core_factory(
                **disk, **{"kv_events.enable_kv_cache_events": True, "kv_events.endpoint": f"tcp://*:{port}"}
            )
        assert str(e.value) == f"kv_events.endpoint = 'tcp://*:{port}': Address already in use"
    core_factory(**disk).close()  # the store was never locked by the engine that failed


def test_a_late_subscriber_past_the_replay_buffer_gets_a_resync(core_factory: Any) -> None:
    """The replay buffer holds 2 batches; a subscriber that joins after many asks from 0: the
    engine answers with a full resync on its next step, which makes the index exact."""
    cfg = _config(buffer_steps=2)
    dotted = {f"kv_events.{k}": v for k, v in msgspec.structs.asdict(cfg).items() if v is not None}
    core = core_factory(**dotted)
    sub = None
    try:
        rng = random.Random(3)
        for _ in range(2):
            core.add_request(core.make_request(rand_tokens(rng, 80), greedy(3)))
            while core.has_work():
                core.step()
        assert core.kv_events is not None and core.kv_events.publisher._next_seq > 4
        sub = KVEventSubscriber(_local(cfg.endpoint), cfg.replay_endpoint)
        time.sleep(0.3)
        assert sub.catch_up() == 0  # batch 0 is long gone from the buffer
        deadline = time.monotonic() + 5.0
        while not core.kv_events.publisher.resync_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        core.kv_events.end_step()  # the next step: the resync
        _drain(sub, core.kv_events.publisher._next_seq - 1)
        want = contents(core.cache.tree)
        assert not sub.stale and sub.index.blocks["GPU"] == want.blocks["GPU"] != set()
        assert sub.index.checkpoints["GPU"] == want.checkpoints["GPU"]
    finally:
        core.close()
        if sub is not None:
            sub.close()
