"""The OpenAI server over an engine core in its own process (``AsyncEngine`` over ``ProcCoreClient``), seen through
the official ``openai`` client: streaming, ``n > 1``, stop strings ending requests in the core,
an abort when the client disconnects, and a killed core (streams end with an error, /health 503)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from deltaserve.engine import AsyncEngine, EngineConfig, EngineCore
from deltaserve.models import LoadedModel
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.serving import BackgroundServer
from tests.engine.conftest import separate
from tests.server.conftest import MODEL, server_engine_config, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

USER = [{"role": "user", "content": "Tell me about the sea."}]


def config() -> EngineConfig:
    return server_engine_config(**{"cache.memory_bytes": 64 * 1024**2})


def client_of(url: str) -> Any:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def proc_served() -> AsyncIterator[tuple[AsyncEngine, BackgroundServer]]:
    engine = AsyncEngine(separate(config()))
    async with serving(engine) as srv:
        yield engine, srv


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def local_url(tiny_loaded: LoadedModel) -> AsyncIterator[str]:
    engine = AsyncEngine(core=EngineCore(config(), loaded=tiny_loaded))
    async with serving(engine) as srv:
        yield srv.url


async def idle_stats(engine: AsyncEngine, timeout: float = 20.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        s = await engine.fetch_stats()
        if s["scheduler.running"] == 0 and s["scheduler.waiting"] == 0:
            return s
        assert asyncio.get_running_loop().time() < deadline, s
        await asyncio.sleep(0.02)


async def streamed_chat(url: str, **kw: Any) -> tuple[dict[int, str], dict[int, str | None]]:
    stream = await client_of(url).chat.completions.create(model=MODEL, messages=USER, stream=True, **kw)
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return texts, reasons


async def test_streaming_and_n_match_the_in_process_server(
    proc_served: tuple[AsyncEngine, BackgroundServer], local_url: str
) -> None:
    _, srv = proc_served
    kw = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    got = await streamed_chat(srv.url, **kw)
    assert got == await streamed_chat(local_url, **kw)
    assert got[1] == {0: "length"} and len(got[0][0]) > 0
    kw_n = {"max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}}
    got_n = await streamed_chat(srv.url, **kw_n)
    assert sorted(got_n[0]) == [0, 1, 2] and set(got_n[1].values()) == {"length"}
    assert got_n == await streamed_chat(local_url, **kw_n)
    done = await client_of(srv.url).completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0
    )
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens <= 5


async def test_a_stop_string_ends_the_request_through_the_core(
    proc_served: tuple[AsyncEngine, BackgroundServer], local_url: str
) -> None:
    engine, srv = proc_served
    kw = {"max_tokens": 32, "temperature": 0, "extra_body": {"ignore_eos": True}}
    free = (await streamed_chat(srv.url, **kw))[0][0]
    stop = free[8:10]
    assert stop and stop in free
    before = (await idle_stats(engine))["requests.aborted"]
    texts, reasons = await streamed_chat(srv.url, stop=[stop], **kw)
    assert reasons == {0: "stop"} and texts[0] == free[: free.index(stop)]
    assert (texts, reasons) == await streamed_chat(local_url, stop=[stop], **kw)
    after = await idle_stats(engine)
    assert after["requests.aborted"] == before + 1  # the front end aborted it in the core
    assert after["tokens.generated"] - (await idle_stats(engine))["tokens.generated"] == 0


async def test_a_client_that_disconnects_aborts_its_request_in_the_core(
    proc_served: tuple[AsyncEngine, BackgroundServer],
) -> None:
    engine, srv = proc_served
    before = await idle_stats(engine)
    body = {"model": MODEL, "messages": USER, "max_tokens": 5000, "stream": True, "ignore_eos": True}
    url = srv.url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as http, http.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        got = 0
        async for line in resp.aiter_lines():
            got += line.startswith("data: ")
            if got >= 4:
                break
    after = await idle_stats(engine)
    assert after["requests.aborted"] == before["requests.aborted"] + 1
    assert after["live_slots.used"] == 0 and after["kv.pinned_blocks"] == 0
    assert after["tokens.generated"] - before["tokens.generated"] < 1000


async def test_a_killed_core_ends_open_streams_with_an_error_and_health_503() -> None:
    engine = AsyncEngine(separate(config()))
    await engine.start()
    try:
        app = create_app(engine, ServerConfig(served_model_names=[MODEL]))
        async with BackgroundServer(app) as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
            body = {
                "model": MODEL,
                "prompt": "Hello",
                "max_tokens": 5000,
                "stream": True,
                "ignore_eos": True,
            }
            frames: list[str] = []
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        frames.append(line[6:])
                        if len(frames) == 2:
                            assert engine.core_pid is not None
                            os.kill(engine.core_pid, signal.SIGKILL)
            assert frames[-1] == "[DONE]"
            assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "error"
            health = await http.get("/health")
            assert health.status_code == 503
            refused = await http.post("/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 503
    finally:
        await engine.shutdown()
