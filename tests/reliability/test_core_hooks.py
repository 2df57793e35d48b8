"""The diagnostics hooks of the core process: ``check_integrity()`` reaches a separate core
(``CheckIntegrity``) and reports its broken accounting as the in-process engine does, and a
malformed ``DELTASERVE_CORE_HOOK`` fails the start with a one-line ``ConfigError``."""

from __future__ import annotations

import asyncio

import pytest

from deltaserve.engine import AsyncEngine
from deltaserve.engine.errors import ConfigError
from deltaserve.models import LoadedModel
from tests.engine.conftest import greedy, make_config, separate
from tests.reliability.conftest import PLACEMENTS, open_engine, tokens
from tests.reliability.core_hooks import HOOK_ENV, inject_leaked_block, use_hook

TIMEOUT = 60.0


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_check_integrity_reports_the_cores_broken_accounting(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, placement: str
) -> None:
    if placement == "separate":
        use_hook(monkeypatch, "leaked_block")
    async with open_engine(placement, tiny_loaded) as engine:
        if engine.core is not None:  # the core runs in this process
            assert engine.core is not None
            inject_leaked_block(engine.core)
        with pytest.raises(AssertionError, match=r"^1 KV blocks leaked \(neither free, cached nor owned\)$"):
            await asyncio.wait_for(engine.check_integrity(), TIMEOUT)
        # the check is a diagnosis, not a fault: the engine serves on
        outs = [o async for o in engine.generate(tokens(20, 1), greedy(3))]
        assert outs[-1].finish_reason == "length"
        assert engine.is_healthy()


async def test_a_malformed_core_hook_fails_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOOK_ENV, "tests.reliability.core_hooks")
    client = AsyncEngine(separate(make_config()))
    with pytest.raises(
        ConfigError,
        match=r"^DELTASERVE_CORE_HOOK = 'tests.reliability.core_hooks': expected module:function$",
    ):
        await asyncio.wait_for(client.start(), TIMEOUT)
    assert client.client.handle is not None and not client.client.handle.alive()  # type: ignore[attr-defined]
