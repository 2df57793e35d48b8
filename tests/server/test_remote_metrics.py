"""Two servers on one Mooncake master (a real one on a free 127.0.0.1 port, stopped in the
test): the second serves the next turn of the first's conversation from the store, and
``/metrics`` shows the remote tier's counters move: what the first published and wrote, what
the second fetched, hit and read."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from deltaserve.cache.remote_tier import RemoteTier
from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.models import LoadedModel
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.serving import BackgroundServer
from tests.cache.remote_helpers import Master, master  # noqa: F401 (a fixture)

from .conftest import MODEL, Served, server_engine_config
from .test_metrics_labels import scrape

pytestmark = pytest.mark.asyncio


@asynccontextmanager
async def _server(tiny_loaded: LoadedModel, url: str) -> AsyncIterator[tuple[Served, EngineCore]]:
    """A server on the store at ``url``, its client joined."""
    config = server_engine_config(**{
        "cache.remote": url, "cache.remote_segment_bytes": "64MiB", "cache.remote_buffer_bytes": "16MiB",
        "cache.remote_timeout_s": 10.0, "cache.remote_write_bytes_per_s": None,
    })  # fmt: skip
    core = EngineCore(config, loaded=tiny_loaded)
    assert isinstance(core.disk, RemoteTier)
    assert core.disk.remote.client.wait_ready(60), "the engine's client did not join the master"
    engine = AsyncEngine(core=core)
    await engine.start()
    try:
        async with BackgroundServer(create_app(engine, ServerConfig(served_model_names=[MODEL]))) as srv:
            yield Served(engine, srv, None), core
    finally:
        await engine.shutdown()


async def _turn(served: Served, core: EngineCore, prompt: list[int]) -> tuple[list[int], dict[str, float]]:
    """Serve ``prompt`` (greedy), wait for its writes to reach the store, scrape."""
    done = await served.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )
    await served.wait_idle()
    assert isinstance(core.disk, RemoteTier)
    assert core.disk.remote.flush(60)  # write-through is asynchronous
    return core.tokenizer.encode(done.choices[0].text, add_special_tokens=False), await scrape(served)


async def test_a_second_server_reports_remote_hits(tiny_loaded: LoadedModel, master: Master) -> None:  # noqa: F811
    rng = random.Random(0)
    turn1 = [rng.randrange(3, 1000) for _ in range(300)]
    # (the store keeps its objects in the memory its clients lend: the first server stays up)
    async with _server(tiny_loaded, master.url) as a, _server(tiny_loaded, master.url) as b:
        answer, first = await _turn(*a, turn1)
        turn2 = turn1 + answer + [rng.randrange(3, 1000) for _ in range(20)]
        _, second = await _turn(*b, turn2)  # an empty tree: its hit is the store's
    assert first["deltaserve:remote_items_published_total"] >= 1
    assert first["deltaserve:remote_bytes_written_total"] > 0
    assert first["deltaserve:remote_hits_total"] == 0
    assert first["deltaserve:remote_bytes_read_total"] == 0
    assert second["deltaserve:remote_fetches_total"] >= 1
    assert second["deltaserve:remote_hits_total"] >= 1
    assert second["deltaserve:remote_bytes_read_total"] > 0
    assert second["deltaserve:prefix_cache_hits_by_tier_total{tier=disk}"] >= 256
    for name in ("fetch_misses", "read_timeouts", "damaged_reads", "call_timeouts", "breaker_opens"):
        assert second[f"deltaserve:remote_{name}_total"] == 0, name
