"""Fixtures of the reliability tests: the built-in tiny model and engine factories (shared
with tests/engine), and the two placements of the engine core a test can run over
(``in_process``: ``AsyncEngine``; ``separate``: ``AsyncEngine`` over ``ProcCoreClient`` and a core process)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.models import LoadedModel
from tests.engine.conftest import core_factory, make_config, separate, tiny_loaded, tiny_path  # noqa: F401 (fixtures)

PLACEMENTS = ["in_process", "separate"]

Engine = AsyncEngine


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture
def engine_factory(tiny_loaded: LoadedModel) -> Callable[..., AsyncEngine]:  # noqa: F811
    """An unstarted AsyncEngine on the shared tiny model (use ``async with``)."""

    def make(**dotted: Any) -> AsyncEngine:
        return AsyncEngine(core=EngineCore(make_config(**dotted), loaded=tiny_loaded))

    return make


def open_engine(placement: str, loaded: LoadedModel, **dotted: Any) -> Engine:
    """An unstarted engine of ``placement`` on the tiny model with ``make_config(**dotted)``
    (a separate core loads the same built-in model in its own process)."""
    config = make_config(**dotted)
    if placement == "in_process":
        return AsyncEngine(core=EngineCore(config, loaded=loaded))
    assert placement == "separate", placement
    return AsyncEngine(separate(config))


async def current_stats(engine: Engine) -> dict[str, Any]:
    """The engine's stats taken now (a separate core is asked; its last sent stats may lag)."""
    if engine.core is None:
        return await engine.fetch_stats()
    return engine.stats()


def assert_idle_pools(stats: dict[str, Any]) -> None:
    """Nothing queued or running, and every pool back to idle: each KV block free or cached
    (unpinned), every live state slot free."""
    assert stats["scheduler.running"] == 0 and stats["scheduler.waiting"] == 0, stats
    assert stats["grammar.parked"] == 0, stats
    assert stats["kv.free_blocks"] + stats["kv.cached_blocks"] == stats["kv.total_blocks"], stats
    assert stats["kv.pinned_blocks"] == 0, stats
    assert stats["live_slots.used"] == 0, stats
