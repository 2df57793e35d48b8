"""Slow clients cannot hold the server: request headers and bodies have read deadlines (the
connection is closed past them), and requests on connections beyond the limit get 503 at once
(the probes excepted); the server goes on serving. Over the scripted stand-in engine, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import httpx

from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.serving import BackgroundServer
from tests.server.test_scripted_engine import ScriptedEngine

CHAT = "/v1/chat/completions"


async def trickle(port: int, lines: list[bytes], every_s: float) -> tuple[float, bytes]:
    """Send ``lines`` one at a time, ``every_s`` apart, until the server closes the connection;
    (seconds until it did, what it answered)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    try:
        for line in lines:
            writer.write(line)
            await writer.drain()
            try:
                data = await asyncio.wait_for(reader.read(65536), every_s)
            except asyncio.TimeoutError:
                continue
            return time.monotonic() - t0, data  # answered, or b"": closed
        return time.monotonic() - t0, await asyncio.wait_for(reader.read(65536), 10)
    except ConnectionError:
        return time.monotonic() - t0, b""
    finally:
        writer.close()


async def test_headers_and_bodies_sent_too_slowly_are_cut_off() -> None:
    engine = ScriptedEngine()
    config = ServerConfig(header_timeout_s=0.5, body_timeout_s=0.5)
    async with BackgroundServer(create_app(engine), config=config) as srv:
        head = [b"POST /v1/chat/completions HTTP/1.1\r\n", b"Host: x\r\n"] + [b"X-Slow: 1\r\n"] * 20
        body = b'{"messages": [{"role": "user", "content": "hi"}]}'
        start = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        start += f"Content-Length: {len(body)}\r\n\r\n"
        slow_body = [start.encode()] + [body[i : i + 2] for i in range(0, len(body), 2)]
        silent = [b""]  # connects and says nothing
        results = await asyncio.gather(
            *(trickle(srv.port, lines, 0.2) for lines in [head] * 4 + [slow_body] * 4 + [silent] * 2)
        )
        for took, answer in results:
            assert answer == b"" and took < 3, (took, answer[:80])  # closed within the deadline
        engine.script = ["served"]
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as http:
            r = await http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "served"


async def test_a_client_in_time_is_not_cut_off() -> None:
    engine = ScriptedEngine()
    config = ServerConfig(header_timeout_s=1.0, body_timeout_s=1.0)
    async with BackgroundServer(create_app(engine), config=config) as srv:
        engine.script = ["fine"]
        body = b'{"messages": [{"role": "user", "content": "hi"}]}'
        start = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        start += f"Content-Length: {len(body)}\r\n\r\n"
        took, answer = await trickle(srv.port, [start.encode(), body[:10], body[10:]], 0.2)
        assert answer.startswith(b"HTTP/1.1 200") and b"fine" in answer, answer[:200]


async def test_connections_past_the_limit_get_503() -> None:
    engine = ScriptedEngine()
    config = ServerConfig(max_connections=2, header_timeout_s=5.0)
    async with BackgroundServer(create_app(engine), config=config) as srv:
        held = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(2)]
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as http:
            r = await http.get("/v1/models")
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
            assert (await http.get("/health")).status_code == 200  # probes pass the limit
            for _, writer in held:
                writer.close()
            await asyncio.sleep(0.2)
            assert (await http.get("/v1/models")).status_code == 200
