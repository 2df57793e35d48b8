"""Fixtures of the reliability tests: the built-in tiny model and engine factories (shared
with tests/engine)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.models import LoadedModel
from tests.engine.conftest import core_factory, make_config, tiny_loaded, tiny_path  # noqa: F401 (fixtures)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture
def engine_factory(tiny_loaded: LoadedModel) -> Callable[..., AsyncEngine]:  # noqa: F811
    """An unstarted AsyncEngine on the shared tiny model (use ``async with``)."""

    def make(**dotted: Any) -> AsyncEngine:
        return AsyncEngine(core=EngineCore(make_config(**dotted), loaded=tiny_loaded))

    return make
