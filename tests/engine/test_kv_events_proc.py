"""Cache events from an engine core in its own process (``engine.core_process = separate``):
the core process publishes; a subscriber on 127.0.0.1 rebuilds what the request cached, and
the counters reach the front end's stats."""

from __future__ import annotations

import socket
import time

import pytest

from deltaserve.cluster.kv_index import KVEventSubscriber
from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams
from tests.engine.conftest import separate

pytestmark = pytest.mark.asyncio(loop_scope="function")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_core_process_publishes_the_cache_events() -> None:
    pub, replay = free_port(), free_port()
    config = EngineConfig.load(None, {
        "scheduler.max_num_batched_tokens": 256, "cache.memory_bytes": 64 * 1024**2,
        "logging.stats_interval_s": 60.0, "kv_events.enable_kv_cache_events": True,
        "kv_events.endpoint": f"tcp://*:{pub}", "kv_events.replay_endpoint": f"tcp://127.0.0.1:{replay}",
    })  # fmt: skip
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        async with AsyncEngine(separate(config)) as engine:
            prompt = list(range(10, 10 + 70))  # 4 full blocks of 16
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True)):
                pass
            stats = await engine.fetch_stats()
            assert stats["kv_events.published"] > 0 and stats["kv_events.dropped"] == 0
            deadline = time.monotonic() + 10.0
            while len(sub.index.blocks["GPU"]) < 4 and time.monotonic() < deadline:
                if not sub.poll(0.05):
                    sub.catch_up()
            assert len(sub.index.blocks["GPU"]) == 4 and not sub.stale
            first = next(k for k, parent in sub.index.parents.items() if parent == 0)
            assert sub.index.tokens[first] == tuple(prompt[:16])
            assert sub.index.checkpoints["GPU"]  # the hybrid model's checkpoints are events too
    finally:
        sub.close()
