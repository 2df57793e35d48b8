"""Request bodies a client gets wrong: too large (413 before the body is read), not UTF-8 or
nested too deep (400), a hang-up while uploading (no answer, not a server error); and the
field an error names. Over the scripted stand-in engine, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import re

import httpx

from deltaserve.engine.errors import InvalidRequestError
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.errors import translate_error
from deltaserve.server.serving import BackgroundServer
from tests.server.test_scripted_engine import ScriptedEngine

CHAT = "/v1/chat/completions"


async def raw_request(port: int, head: bytes, body: bytes = b"", *, read: bool = True) -> bytes:
    """Send ``head`` (request line + headers) and ``body`` on a fresh connection; the response
    bytes (until the server closes, at most 10 s), or b"" when ``read`` is false (hang up)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"\r\n" + body)
    await writer.drain()
    data = b""
    if read:
        data = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    return data


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_a_body_over_the_limit_is_refused_before_it_is_read() -> None:
    engine = ScriptedEngine()
    async with BackgroundServer(create_app(engine, ServerConfig(max_body_bytes=4096))) as srv:
        # 50 MB announced, nothing sent: the 413 comes back without waiting for the body
        head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {50 << 20}\r\n"
        raw = await raw_request(srv.port, head.encode())
        status_line, _, rest = raw.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 413"), raw[:200]
        err = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == "request_too_large" and "4096" in err["message"]
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:

            async def chunks():  # no Content-Length: refused once past the limit
                for _ in range(10):
                    yield b" " * 1000

            r = await http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            engine.script = ["fine"]
            r = await http.post("/v1/completions", json={"prompt": "x" * 3000, "max_tokens": 1})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "fine"
            text = (await http.get("/metrics")).text
        assert metric(text, 'deltaserve:http_errors_total{model_name="scripted",status="413"}') == 2


async def test_the_default_limit_is_sized_from_the_model() -> None:
    engine = ScriptedEngine()  # max_model_len 4096: max(1 MiB, 32 x 4096) = 1 MiB
    async with BackgroundServer(create_app(engine)) as srv, httpx.AsyncClient(base_url=srv.url) as http:
        engine.script = ["ok"]
        body = {"prompt": "a" * ((1 << 20) - 100), "max_tokens": 1}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        body["prompt"] = "a" * (1 << 20)
        assert (await http.post("/v1/completions", json=body)).status_code == 413


async def test_bad_utf8_and_deep_nesting_are_400_and_the_server_stays_healthy() -> None:
    engine = ScriptedEngine()
    async with BackgroundServer(create_app(engine)) as srv, httpx.AsyncClient(base_url=srv.url) as http:
        bad_utf8 = b'{"messages": [{"role": "user", "content": "a\xff\xfeb"}]}'
        deep = b'{"messages": [{"role": "user", "content": "x"}], "junk": ' + b"[" * 1000 + b"]" * 1000 + b"}"
        deep_known = (  # a field the schema takes as it is (any JSON)
            b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
            + b"[" * 5000
            + b"]" * 5000
            + b"}}"
        )
        for path, body, words in (
            (CHAT, bad_utf8, "not valid UTF-8"),
            (CHAT, deep, "nests JSON too deeply"),
            (CHAT, deep_known, "nests JSON too deeply"),
        ):
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_json" and words in err["message"]
        engine.script = ["still here"]
        r = await http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "still here"
        assert (
            metric(
                (await http.get("/metrics")).text,
                'deltaserve:http_errors_total{model_name="scripted",status="500"}',
            )
            == 0
        )


async def test_a_hang_up_while_uploading_is_no_server_error() -> None:
    engine = ScriptedEngine()
    async with BackgroundServer(create_app(engine)) as srv, httpx.AsyncClient(base_url=srv.url) as http:
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
        )
        for _ in range(5):
            await raw_request(srv.port, head.encode(), b'{"messages": [', read=False)
        for _ in range(100):  # the server notices each hang-up when it reads on
            text = (await http.get("/metrics")).text
            if metric(text, 'deltaserve:client_disconnects_total{model_name="scripted"}') >= 5:
                break
            await asyncio.sleep(0.05)
        assert metric(text, 'deltaserve:client_disconnects_total{model_name="scripted"}') == 5
        assert not re.search(
            r'^deltaserve:http_errors_total\{model_name="scripted",status="5', text, re.M
        )  # no 5xx


async def test_a_text_part_without_text_is_named() -> None:
    engine = ScriptedEngine()
    async with BackgroundServer(create_app(engine)) as srv, httpx.AsyncClient(base_url=srv.url) as http:
        body = {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
        r = await http.post(CHAT, json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages"
        assert err["message"] == "messages[0].content[0] (content part 0) has no text"


def test_template_errors_name_their_field() -> None:
    for message, param in (
        ("chat_template_kwargs must be an object with string keys, got 1", "chat_template_kwargs"),
        ("chat_template_kwargs may not set ['tokenize']", "chat_template_kwargs"),
        ("tools must be a list of objects (function schemas), got 1", "tools"),
    ):
        err = translate_error(InvalidRequestError(message), {"prompt": "messages"})
        assert (err.status, err.param) == (400, param)
