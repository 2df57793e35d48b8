"""The router's view of a replica built from its cache events (``cluster/kv_feed.py``).

A real engine (built-in tiny model, small pools: evictions) publishes on 127.0.0.1; the
affinity index, fed by ``EventFeeds`` from the endpoint its report names, holds exactly the
routing keys of what the cache holds after every request, although the polled report it also
got is empty and stale; a replica whose stream cannot be followed is routed on its reports."""

from __future__ import annotations

import random
import socket
import time
from typing import Any

import pytest
import torch

from deltaserve.cache.event_collector import contents
from deltaserve.cluster.affinity import AffinityIndex, RouteHint, pack_keys, route_keys, short_key
from deltaserve.cluster.kv_feed import EventFeeds
from deltaserve.cluster.kv_index import connectable
from deltaserve.engine import EngineConfig, EngineCore, SamplingParams
from deltaserve.kernels import get_ops
from deltaserve.models import LoadedModel, ensure_builtin_model, load_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(
        ensure_builtin_model("tiny-qwen3.5"), dtype=torch.float32, device="cpu", ops=get_ops("reference")
    )


def _core(loaded: LoadedModel, **extra: Any) -> EngineCore:
    cfg = EngineConfig.load(None, {
        "model.device": "cpu", "model.dtype": "float32",
        "cache.memory_bytes": 64 * 1024**2, "cache.num_kv_blocks": 16, "cache.checkpoint_pool_bytes": "1MiB",
        "scheduler.max_num_batched_tokens": 256, "logging.stats_interval_s": 60.0, **extra,
    })  # fmt: skip
    return EngineCore(cfg, loaded=loaded)


def _run(core: EngineCore, ids: list[int]) -> None:
    core.add_request(core.make_request(ids, SamplingParams(max_tokens=3, ignore_eos=True)))
    while core.has_work():
        core.step()


def _report(core: EngineCore, seq: int) -> dict[str, Any]:
    """A report as ``EngineReplica.record_routing_stats`` sends it, with no (stale) keys."""
    assert core.kv_events is not None
    pub = core.kv_events.publisher
    return {
        "seq": seq, "time": time.time(), "ckpt_keys": pack_keys([]), "kv_keys": pack_keys([]),
        "kv_events": {"endpoint": connectable(pub.endpoint, "127.0.0.1"),
                      "replay_endpoint": pub.replay_endpoint, "topic": ""},
    }  # fmt: skip


def _caught_up(core: EngineCore, feeds: EventFeeds, index: AffinityIndex) -> None:
    assert core.kv_events is not None
    target = core.kv_events.publisher._next_seq - 1
    sub = feeds.subscribers["r0"][1]
    deadline = time.monotonic() + 10.0
    while sub.last_seq < target and time.monotonic() < deadline:
        feeds.refresh(index)
        time.sleep(0.02)
    assert sub.last_seq == target


def test_the_router_view_is_the_cache_rebuilt_from_events_across_evictions(loaded: LoadedModel) -> None:
    endpoint = f"tcp://*:{free_port()}"
    core = _core(loaded, **{
        "kv_events.enable_kv_cache_events": True, "kv_events.endpoint": endpoint,
        "kv_events.replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    })  # fmt: skip
    index, feeds = AffinityIndex(), EventFeeds()
    try:
        index.set_replicas(["r0"])
        report = _report(core, 1)
        index.on_report("r0", report)
        feeds.on_report("r0", report)
        rng = random.Random(4)
        convs = [[rng.randrange(10, 900) for _ in range(100)] for _ in range(5)]
        unit, bs = core.cache.unit, core.cache.block_size
        salt = core.make_request(convs[0], SamplingParams(max_tokens=1)).cache_salt
        joints: list[int] = []
        removed: set[int] = set()
        prev_kv: set[int] = set()
        for ids in convs + convs[:1]:
            _run(core, ids)
            _caught_up(core, feeds, index)
            held = contents(core.cache.tree)
            view = index.views["r0"]
            assert view.events and index.summary()["replicas"]["r0"]["keys_from"] == "events"
            ckpts = set().union(*held.checkpoints.values())
            blocks = set().union(*held.blocks.values())
            assert set(view.ckpt_reported) == {short_key(k) for k in ckpts}
            assert set(view.kv_reported) == {short_key(k) for k in blocks}
            first = route_keys(convs[0] + [1], block_size=bs, unit=unit, salt=salt)
            hint = RouteHint(tuple(first), unit, len(convs[0]) + 1)
            joint, _ = index.match("r0", hint)
            # what a request for the first conversation would really hit there now
            real = max((i + 1 for i, k in enumerate(first) if k in view.ckpt_reported), default=0)
            assert joint == hint.tokens_at(real)
            joints.append(joint)
            removed |= prev_kv - set(view.kv_reported)  # evictions reach the view
            prev_kv = set(view.kv_reported)
        assert joints[0] > 0 and joints[-1] > 0, joints
        assert core.stats()["kv.evicted_blocks"] > 0 and removed
    finally:
        feeds.close()
        core.close()


def test_a_replica_whose_stream_cannot_be_followed_is_routed_on_its_reports() -> None:
    index, feeds = AffinityIndex(), EventFeeds(replay_timeout_s=0.05)
    try:
        index.set_replicas(["r0"])
        report = {
            "seq": 1, "time": time.time(), "ckpt_keys": pack_keys([11, 12]), "kv_keys": pack_keys([10]),
            "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}",  # nobody publishes there
                          "replay_endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": ""},
        }  # fmt: skip
        index.on_report("r0", report)
        feeds.on_report("r0", report)
        feeds.refresh(index)
        view = index.views["r0"]
        assert not view.events and set(view.ckpt_reported) == {11, 12} and set(view.kv_reported) == {10}
        assert index.summary()["replicas"]["r0"]["keys_from"] == "reports"
    finally:
        feeds.close()
