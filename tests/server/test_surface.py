"""The HTTP surface around the model: the API key, CORS, ``/v1/models/{id}`` and ``/version``,
against a real server (uvicorn on 127.0.0.1, a free port) over the scripted engine, with the
official ``openai`` client and httpx."""

from __future__ import annotations

import hmac
import importlib.metadata
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import pytest_asyncio

from deltaserve.server import auth, protocol, unsupported
from deltaserve.server.app import create_app, package_version
from deltaserve.server.config import ServerConfig
from deltaserve.server.serving import BackgroundServer

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


# ---------------------------------------------------------------------------- unsupported fields
#: a value that uses each refused field (a field added to the rule needs one here)
USING: dict[str, dict[str, Any]] = {
    "best_of": {"best_of": 2},
    "logit_bias": {"logit_bias": {"5": 10.0}},
    "reasoning_effort": {"reasoning_effort": "low"},
    "functions": {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
    "function_call": {"function_call": "auto"},
    "prediction": {"prediction": {"type": "content", "content": "x"}},
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "modalities": {"modalities": ["text", "audio"]},
    "suffix": {"suffix": "the end"},
    "use_beam_search": {"use_beam_search": True},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "skip_special_tokens": {"skip_special_tokens": False},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 8},
    "allowed_token_ids": {"allowed_token_ids": [1, 2]},
    "bad_words": {"bad_words": ["no"]},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {"continue_final_message": True},
    "documents": {"documents": [{"title": "t", "text": "x"}]},
}
#: values that do not use a field: accepted, the output unchanged
NEUTRAL = {
    "best_of": 1, "logit_bias": {}, "modalities": ["text"], "suffix": "", "use_beam_search": False,
    "skip_special_tokens": True, "add_generation_prompt": True, "functions": [], "bad_words": [],
    "stream_options": {"include_usage": False, "continuous_usage_stats": False},
    "user": "user-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
}  # fmt: skip


async def test_every_refused_field_has_a_case() -> None:
    assert set(USING) == {f.name for f in unsupported.REFUSED}


@pytest.mark.parametrize("field", sorted(USING))
async def test_a_refused_field_gets_the_same_400(plain: str, field: str) -> None:
    async with httpx.AsyncClient(base_url=plain, timeout=30) as http:
        if field == "suffix":
            resp = await http.post("/v1/completions", json={"prompt": "x", **USING[field]})
        else:
            resp = await http.post("/v1/chat/completions", json={**CHAT, **USING[field]})
            if field in ("best_of", "logit_bias", "truncate_prompt_tokens", "bad_words"):  # both endpoints
                other = await http.post("/v1/completions", json={"prompt": "x", **USING[field]})
                assert other.status_code == 400 and other.json()["error"]["param"] == field
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported"
    assert error["param"] == field and error["message"].startswith(f"{field} is not supported")


async def test_neutral_values_and_ignored_fields_are_accepted(plain: str) -> None:
    async with httpx.AsyncClient(base_url=plain, timeout=30) as http:
        base = await http.post("/v1/chat/completions", json=CHAT)
        resp = await http.post("/v1/chat/completions", json={**CHAT, **NEUTRAL})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"] == base.json()["choices"]
        done = await http.post(
            "/v1/completions", json={"prompt": "x", "suffix": "", "user": "u", "best_of": 1}
        )
        assert done.status_code == 200, done.text


async def test_the_official_client_sees_the_refusal(plain: str) -> None:
    c = client(plain, "none")
    with pytest.raises(openai.BadRequestError) as info:
        await c.chat.completions.create(model="scripted", reasoning_effort="low", **CHAT)  # type: ignore[call-overload]
    assert info.value.code == "unsupported" and info.value.param == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as info:
        await c.completions.create(model="scripted", prompt="x", best_of=3, n=1)
    assert info.value.param == "best_of"
    ok = await c.chat.completions.create(model="scripted", user="someone", store=False, **CHAT)  # type: ignore[call-overload]
    assert ok.choices[0].message.content == "a"


async def test_the_declared_fields_and_the_docs_follow_the_rule() -> None:
    declared = {f.name for f in msgspec.structs.fields(protocol._UnimplementedFields)}
    listed = {f.name.split(".")[0] for f in unsupported.FIELDS}
    # every declared field is in the rule; the rule's others are declared by the request structs
    assert declared <= listed
    for name in listed - declared:
        assert any(
            name in {f.name for f in msgspec.structs.fields(t)}
            for t in (protocol.ChatCompletionRequest, protocol.CompletionRequest)
        ), name
    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text(encoding="utf-8")
    for f in unsupported.FIELDS:
        assert f"| `{f.name}` | {f.rule.value} |" in doc, f"docs/server.md lacks the row of {f.name}"


async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(plain: str) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it): every chunk carries
    the usage so far, and the last chunk the total."""
    body = {
        **CHAT, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    async with httpx.AsyncClient(base_url=plain, timeout=30) as http:
        resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    assert chunks and all(c["usage"] is not None for c in chunks)
    completed = [c["usage"]["completion_tokens"] for c in chunks]
    assert completed == sorted(completed) and completed[-1] >= 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == chunks[-2]["usage"]  # the total
    assert chunks[0]["usage"]["prompt_tokens"] > 0
