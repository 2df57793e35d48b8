"""Fixtures: one engine on the built-in tiny model behind one server per test module, on
127.0.0.1 and a free port, in the module's event loop (so tests can also call the engine)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import torch

from deltaserve.engine import AsyncEngine, EngineConfig, EngineCore
from deltaserve.kernels import get_ops
from deltaserve.models import LoadedModel, ensure_builtin_model, load_model
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.serving import BackgroundServer

MODEL = "builtin:tiny-qwen3.5"


@contextlib.asynccontextmanager
async def serving(engine: Any, config: ServerConfig | None = None) -> AsyncIterator[BackgroundServer]:
    """``engine`` started and served on 127.0.0.1 (a free port) for the block, then shut down."""
    await engine.start()
    try:
        async with BackgroundServer(
            create_app(engine, config or ServerConfig(served_model_names=[MODEL]))
        ) as srv:
            yield srv
    finally:
        await engine.shutdown()


def server_engine_config(**dotted: Any) -> EngineConfig:
    base: dict[str, Any] = {
        "scheduler.max_num_batched_tokens": 512,
        "scheduler.max_num_seqs": 32,
        "cache.memory_bytes": 128 * 1024**2,
        "logging.stats_interval_s": 60.0,
    }
    base.update(dotted)
    return EngineConfig.load(None, base)


@pytest.fixture(scope="session")
def tiny_loaded() -> LoadedModel:
    path = ensure_builtin_model("tiny-qwen3.5")
    return load_model(path, dtype=torch.float32, device="cpu", ops=get_ops("reference"))


@dataclass
class Served:
    engine: AsyncEngine
    server: BackgroundServer
    app: Any

    @property
    def url(self) -> str:
        return self.server.url

    def client(self) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60.0)

    async def wait_idle(self, timeout: float = 20.0) -> dict[str, Any]:
        """Until nothing runs or waits; then the engine's integrity check; its stats."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            s = self.engine.stats()
            if s["scheduler.running"] == 0 and s["scheduler.waiting"] == 0:
                break
            assert asyncio.get_running_loop().time() < deadline, f"engine not idle: {s}"
            await asyncio.sleep(0.02)
        check = getattr(self.engine, "check_integrity", None)
        if check is not None:
            await check()
        else:
            self.engine.core.check_integrity()
        return self.engine.stats()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_loaded: LoadedModel) -> AsyncIterator[Served]:
    core = EngineCore(server_engine_config(), loaded=tiny_loaded)
    engine = AsyncEngine(core=core)
    await engine.start()
    app = create_app(engine, ServerConfig(served_model_names=[MODEL, "tiny"]))
    try:
        async with BackgroundServer(app) as srv:
            yield Served(engine, srv, app)
    finally:
        await engine.shutdown()
