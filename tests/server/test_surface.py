"""The HTTP surface around the model: the API key, CORS, ``/v1/models/{id}`` and ``/version``,
against a real server (uvicorn on 127.0.0.1, a free port) over the scripted engine, with the
official ``openai`` client and httpx."""

from __future__ import annotations

import hmac
import importlib.metadata
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from deltaserve.server import auth
from deltaserve.server.app import create_app, package_version
from deltaserve.server.cli import BackgroundServer
from deltaserve.server.config import ServerConfig

from .test_scripted_engine import ScriptedEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sk-test-0123456789"
ORIGIN = "http://app.example"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def guarded() -> AsyncIterator[tuple[ScriptedEngine, str]]:
    """A server with an API key and CORS for one origin, serving two names."""
    engine = ScriptedEngine()
    engine.script = ["a", "b"]
    config = ServerConfig(
        served_model_names=["qwen", "Qwen/Qwen3.5-0.8B"], api_key=KEY, allowed_origins=[ORIGIN]
    )
    async with BackgroundServer(create_app(engine, config)) as srv:
        yield engine, srv.url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain() -> AsyncIterator[str]:
    """A server with neither a key nor CORS (the defaults)."""
    engine = ScriptedEngine()
    engine.script = ["a"]
    async with BackgroundServer(create_app(engine)) as srv:
        yield srv.url


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30.0)


def assert_401(resp: httpx.Response, message_part: str) -> None:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert error["param"] is None and message_part in error["message"]
    assert KEY not in resp.text


# ---------------------------------------------------------------------------- API key
async def test_the_official_client_needs_the_key(guarded: tuple[ScriptedEngine, str]) -> None:
    url = guarded[1]
    with pytest.raises(openai.AuthenticationError) as info:
        await client(url, "sk-wrong").chat.completions.create(model="qwen", **CHAT)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    good = client(url, KEY)
    resp = await good.chat.completions.create(model="qwen", **CHAT)
    assert resp.choices[0].message.content == "ab"
    assert [m.id for m in (await good.models.list()).data] == ["qwen", "Qwen/Qwen3.5-0.8B"]


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "no API key provided"),
        ({"Authorization": f"Bearer {KEY}x"}, "incorrect API key"),
        ({"Authorization": f"Bearer {KEY[:-1]}"}, "incorrect API key"),
        ({"Authorization": f"Basic {KEY}"}, "incorrect API key"),
        ({"Authorization": KEY}, "incorrect API key"),
        ({"Authorization": "Bearer"}, "incorrect API key"),
    ],
)
async def test_every_guarded_route_refuses_a_missing_or_wrong_key(
    guarded: tuple[ScriptedEngine, str], headers: dict[str, str], message: str
) -> None:
    async with httpx.AsyncClient(base_url=guarded[1], timeout=30, headers=headers) as http:
        for method, path, body in (
            ("POST", "/v1/chat/completions", CHAT),
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
            ("GET", "/v1/models", None),
            ("GET", "/v1/models/qwen", None),
            ("POST", "/tokenize", {"prompt": "x"}),
            ("POST", "/detokenize", {"tokens": [1]}),
            ("GET", "/v1/no-such-route", None),
        ):
            assert_401(await http.request(method, path, json=body), message)


async def test_the_scheme_is_case_insensitive_and_open_routes_stay_open(
    guarded: tuple[ScriptedEngine, str],
) -> None:
    async with httpx.AsyncClient(base_url=guarded[1], timeout=30) as http:
        for path in ("/health", "/metrics", "/version"):
            assert (await http.get(path)).status_code == 200, path
        resp = await http.post("/tokenize", json={"prompt": "ab"}, headers={"Authorization": f"bearer {KEY}"})
        assert resp.status_code == 200 and resp.json()["tokens"] == [97 % 100, 98 % 100]
        metrics = (await http.get("/metrics")).text
    assert 'deltaserve:http_errors_total{model_name="qwen",status="401"}' in metrics


async def test_the_key_is_compared_in_constant_time(
    guarded: tuple[ScriptedEngine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    async with httpx.AsyncClient(base_url=guarded[1], timeout=30) as http:
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await http.get("/v1/models", headers={"Authorization": "Basic " + KEY})).status_code == 401
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer " + KEY})).status_code == 200
    # every check went through compare_digest, a wrong scheme too
    assert calls == [(b"nope", KEY.encode()), (KEY.encode(), KEY.encode()), (KEY.encode(), KEY.encode())]


# ---------------------------------------------------------------------------- CORS
async def test_a_preflight_is_answered_when_cors_is_on(guarded: tuple[ScriptedEngine, str]) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    async with httpx.AsyncClient(base_url=guarded[1], timeout=30) as http:
        resp = await http.options("/v1/chat/completions", headers=preflight)  # no key on a preflight
        assert resp.status_code == 200, resp.text
        assert resp.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in resp.headers["access-control-allow-methods"]
        assert "authorization" in resp.headers["access-control-allow-headers"].lower()
        other = await http.options(
            "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}
        )
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # the actual request: CORS headers on a success and on a 401 (so the page can read it)
        ok = await http.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        refused = await http.get("/v1/models", headers={"Origin": ORIGIN})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


async def test_without_cors_a_preflight_is_a_405_and_no_key_is_needed(plain: str) -> None:
    async with httpx.AsyncClient(base_url=plain, timeout=30) as http:
        resp = await http.options(
            "/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        )
        assert resp.status_code == 405 and "access-control-allow-origin" not in resp.headers
        assert (await http.get("/v1/models")).status_code == 200


# ---------------------------------------------------------------------------- models, version
async def test_models_retrieve(guarded: tuple[ScriptedEngine, str]) -> None:
    c = client(guarded[1], KEY)
    for name in ("qwen", "Qwen/Qwen3.5-0.8B"):  # a name with a slash: the client sends it as is
        card = await c.models.retrieve(name)
        assert card.id == name and card.object == "model" and card.owned_by == "deltaserve"
        assert card.model_extra is not None and card.model_extra["max_model_len"] == 4096
    with pytest.raises(openai.NotFoundError) as info:
        await c.models.retrieve("gpt-4")
    assert info.value.code == "model_not_found"
    body: Any = info.value.body
    assert "'gpt-4' does not exist" in body["message"] and body["param"] == "model"
    async with httpx.AsyncClient(base_url=guarded[1], timeout=30) as http:
        resp = await http.get("/v1/models/", headers={"Authorization": f"Bearer {KEY}"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


async def test_version(plain: str) -> None:
    async with httpx.AsyncClient(base_url=plain, timeout=30) as http:
        resp = await http.get("/version")
    assert resp.status_code == 200 and resp.json() == {"version": package_version()}
    try:
        want = importlib.metadata.version("deltaserve")
    except importlib.metadata.PackageNotFoundError:
        import deltaserve

        want = deltaserve.__version__
    assert package_version() == want and want.count(".") >= 1
