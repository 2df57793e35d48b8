"""A server restarted on the same disk path serves the next turn from disk, and ``/metrics``
shows it: hits by tier, the disk tier's bytes, reads and gauges."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.models import LoadedModel
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.serving import BackgroundServer

from .conftest import MODEL, Served, server_engine_config
from .test_metrics_labels import scrape

pytestmark = pytest.mark.asyncio


async def _turn(
    tiny_loaded: LoadedModel, store: Path, prompt: list[int]
) -> tuple[list[int], dict[str, float]]:
    """One server on ``store``: serve ``prompt`` (greedy), scrape, shut down (which writes
    what the disk lacks and flushes)."""
    core = EngineCore(server_engine_config(**{"cache.disk_path": str(store)}), loaded=tiny_loaded)
    engine = AsyncEngine(core=core)
    await engine.start()
    try:
        async with BackgroundServer(create_app(engine, ServerConfig(served_model_names=[MODEL]))) as srv:
            served = Served(engine, srv, None)
            done = await served.client().completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            await served.wait_idle()
            metrics = await scrape(served)
    finally:
        await engine.shutdown()
    text = done.choices[0].text
    return core.tokenizer.encode(text, add_special_tokens=False), metrics


async def test_restarted_server_reports_disk_hits(tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    rng = random.Random(0)
    turn1 = [rng.randrange(3, 1000) for _ in range(300)]
    answer, first = await _turn(tiny_loaded, tmp_path / "store", turn1)
    assert first["deltaserve:prefix_cache_hits_by_tier_total{tier=disk}"] == 0
    assert first["deltaserve:disk_cache_capacity_bytes"] > 0
    turn2 = turn1 + answer + [rng.randrange(3, 1000) for _ in range(20)]
    _, second = await _turn(tiny_loaded, tmp_path / "store", turn2)
    assert second["deltaserve:prefix_cache_hits_by_tier_total{tier=disk}"] >= 256
    assert second["deltaserve:disk_reads_total"] >= 1
    assert second["deltaserve:disk_bytes_read_total"] > 0
    assert second["deltaserve:disk_cache_items"] > 0 and second["deltaserve:disk_cache_bytes"] > 0
    assert second["deltaserve:disk_damaged_items_total"] == 0
