"""Two Ray Serve replicas of the built-in model on one Mooncake Store master: a conversation
whose next turn lands on the other replica is served from the shared store, with outputs
equal to a single cache-off engine's.

Slow (``-m slow``): Ray start and two replicas take about a minute on two cores. The
cache-blind ``pow2`` router moves about half the follow-up turns to the other replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="needs Ray: pip install 'deltaserve[cluster]'")

import httpx  # noqa: E402

from deltaserve.cluster.config import ClusterConfig  # noqa: E402
from deltaserve.cluster.local import RayCluster  # noqa: E402
from deltaserve.engine import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from tests.cache.remote_helpers import Master, run_master  # noqa: E402
from tests.cluster.test_ray_cluster import complete, prompt, route_of  # noqa: E402

pytestmark = pytest.mark.slow

CONVERSATIONS, MAX_TOKENS = 8, 8


def engine_config(**extra: Any) -> EngineConfig:
    dotted: dict[str, Any] = {
        "cache.memory_bytes": 96 * 1024**2,
        "scheduler.max_num_seqs": 16,
        "scheduler.max_num_batched_tokens": 512,
        "logging.stats_interval_s": 60.0,
    }
    dotted.update(extra)
    return EngineConfig.load(None, dotted)


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    yield from run_master()


async def test_a_turn_moved_to_the_other_replica_is_served_from_the_store(master: Master) -> None:
    cfg = engine_config(**{
        "cache.remote": master.url, "cache.remote_write_bytes_per_s": None,
        "cache.remote_segment_bytes": "64MiB", "cache.remote_buffer_bytes": "16MiB", "cache.remote_timeout_s": 10.0,
    })  # fmt: skip
    firsts = [prompt(3000 + k, 150) for k in range(CONVERSATIONS)]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with RayCluster(num_cpus=2) as rc:
        url = rc.deploy(cfg, ClusterConfig(replicas=2, router="pow2", num_cpus=0.5, app_name="ds-remote",
                                            max_ongoing_requests=16, stats_period_s=0.5))  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as c:
            moved: list[tuple[list[int], dict[str, Any]]] = []
            for k, ids in enumerate(firsts):  # one at a time: each turn's writes land before the next
                first = await complete(c, ids, MAX_TOKENS, request_id=f"r-c{k}-t0")
                await asyncio.sleep(1.0)  # write-through is asynchronous
                ids2 = ids + first["choices"][0]["token_ids"] + prompt(4000 + k, 40)
                second = await complete(c, ids2, MAX_TOKENS, request_id=f"r-c{k}-t1")
                routes = [await route_of(c, f"r-c{k}-t{t}") for t in (0, 1)]
                if routes[0] != routes[1]:
                    moved.append((ids2, second))
    assert moved, "pow2 kept every conversation on one replica (1 in 2**8)"
    async with AsyncEngine(engine_config(**{"cache.enable_prefix_caching": False})) as ref:
        for ids2, second in moved:
            toks: list[int] = []
            async for o in ref.generate(ids2, greedy):
                toks += o.token_ids
            assert second["choices"][0]["token_ids"] == toks
    # a moved turn found its prefix in the store (the other replica's tree never saw it)
    assert all(s["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for _, s in moved), [
        s["usage"] for _, s in moved
    ]
