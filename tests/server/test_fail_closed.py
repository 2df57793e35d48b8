"""``deltaserve serve`` fails closed: a key given empty, ``*`` origins with credentials, an empty
list entry, an empty host and two different keys are start-up errors (before the model loads);
an explicit origin list never answers ``null`` unless it lists it; past ``max_connections`` the
probes are still served while API requests get 503; the front ends never share their port with
another server. (The core's socket file and the front ends' share of connections:
``test_fail_closed_procs.py``.)"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from deltaserve.engine import RequestOutput, SamplingParams
from deltaserve.engine.errors import ConfigError
from deltaserve.server.app import create_app
from deltaserve.server.cli import API_KEY_ENV, build_parser, server_config_from_args
from deltaserve.server.config import ServerConfig
from tests.server.test_scripted_engine import ScriptedEngine

CHAT = "/v1/chat/completions"
MESSAGES = {"messages": [{"role": "user", "content": "hi"}]}


def config_of(argv: list[str], env: dict[str, str] | None = None) -> ServerConfig:
    return server_config_from_args(
        build_parser().parse_args(["serve", *argv]), env={} if env is None else env
    )


# ---------------------------------------------------------------- the API key
@pytest.mark.parametrize("key", ["", " ", "\t\n"])
def test_an_empty_api_key_option_is_an_error(key: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_of(["--api-key", key])
    assert str(e.value) == "--api-key is empty: give a key, or leave it unset for no key"


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_variable_is_an_error(key: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_of([], {API_KEY_ENV: key})
    assert str(e.value) == f"${API_KEY_ENV} is empty: give a key, or leave it unset for no key"


def test_a_key_a_client_cannot_send_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^--api-key has leading or trailing whitespace"):
        config_of(["--api-key", "sk-key\n"])
    with pytest.raises(ConfigError, match=r"^\$DELTASERVE_API_KEY has characters an HTTP header cannot"):
        config_of([], {API_KEY_ENV: "sk-\x00key"})
    with pytest.raises(ConfigError, match=r"^server.api_key is empty"):
        ServerConfig(api_key="")


def test_a_key_given_both_ways() -> None:
    with pytest.raises(ConfigError) as e:
        config_of(["--api-key", "sk-one"], {API_KEY_ENV: "sk-two"})
    assert str(e.value) == f"--api-key and ${API_KEY_ENV} are both set, to different keys: give one"
    assert "sk-" not in str(e.value)  # never the keys themselves
    assert config_of(["--api-key", "sk-one"], {API_KEY_ENV: "sk-one"}).api_key == "sk-one"
    assert config_of([], {API_KEY_ENV: "sk-env"}).api_key == "sk-env"
    assert config_of([], {}).api_key is None


def test_the_command_exits_2_on_an_empty_key_before_loading_the_model() -> None:
    env = {**os.environ, API_KEY_ENV: ""}
    # a model path that does not exist: reached only if the key check let the start go on
    cmd = [sys.executable, "-m", "deltaserve", "serve", "/nonexistent/model", "--host", "127.0.0.1",
           "--port", "0"]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"deltaserve: error: ${API_KEY_ENV} is empty: give a key, or leave it unset for no key"
    ]
    assert done.stdout == "" and time.monotonic() - t0 < 60


# ---------------------------------------------------------------- CORS and the host
@pytest.mark.parametrize("origins", ["*", '["*"]', "https://a.example,*"])
def test_any_origin_with_credentials_is_an_error(origins: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_of(["--allowed-origins", origins, "--allow-credentials"])
    message = str(e.value)
    assert "\n" not in message and "--allow-credentials" in message and "--allowed-origins" in message
    assert message.endswith("list the origins allowed instead")
    assert config_of(["--allowed-origins", origins]).allowed_origins[-1] == "*"  # without: allowed


@pytest.mark.parametrize(
    "value", ["", " ", "https://a.example,", "https://a.example,,https://b.example", '[""]']
)
def test_an_empty_list_entry_is_an_error(value: str) -> None:
    for option in ("--allowed-origins", "--allowed-methods", "--allowed-headers"):
        with pytest.raises(ConfigError) as e:
            config_of([option, value])
        assert str(e.value) == f"{option} {value!r}: an empty entry"


def test_an_empty_host_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^server.host = '': must name an address"):
        config_of(["--host", ""])


async def test_a_listed_origin_list_with_credentials_never_answers_null() -> None:
    from deltaserve.server.serving import BackgroundServer

    engine = ScriptedEngine()
    for listed, null_allowed in ((["https://a.example"], False), (["https://a.example", "null"], True)):
        config = ServerConfig(allowed_origins=listed, allow_credentials=True)
        async with (
            BackgroundServer(create_app(engine, config)) as srv,
            httpx.AsyncClient(base_url=srv.url, timeout=10) as http,
        ):
            for origin, allowed in (
                ("https://a.example", True),
                ("null", null_allowed),
                ("https://b.example", False),
            ):
                r = await http.get("/version", headers={"Origin": origin})
                assert r.headers.get("access-control-allow-origin") == (origin if allowed else None), origin
                pre = await http.options(
                    "/v1/models", headers={"Origin": origin, "Access-Control-Request-Method": "GET"}
                )
                assert pre.status_code == (200 if allowed else 400), origin
                assert pre.headers.get("access-control-allow-origin") == (origin if allowed else None), origin


# ---------------------------------------------------------------- the probes past the limit
class EndlessEngine(ScriptedEngine):
    """Streams ``piece`` every 20 ms until the request is aborted (``script``: as scripted)."""

    piece = ""

    async def _run(self, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if not self.piece:
            async for out in super()._run(params):
                yield out
            return
        while True:
            yield RequestOutput(request_id="r", token_ids=[1], text=self.piece, num_prompt_tokens=7)
            await asyncio.sleep(0.02)


async def hold_stream(port: int) -> asyncio.StreamWriter:
    """A streamed chat request whose client never reads the reply: it stays in flight."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body)
    await writer.drain()
    return writer


async def test_probes_are_served_past_the_connection_limit() -> None:
    from deltaserve.server.serving import BackgroundServer

    engine = EndlessEngine()
    engine.piece = "x" * 1000  # streams that never end, never read
    config = ServerConfig(max_connections=8, header_timeout_s=60.0)
    async with (
        BackgroundServer(create_app(engine, config), config=config) as srv,
        httpx.AsyncClient(
            base_url=srv.url, timeout=10, limits=httpx.Limits(max_keepalive_connections=0)
        ) as http,
    ):
        streams = [await hold_stream(srv.port) for _ in range(4)]
        idle = [(await asyncio.open_connection("127.0.0.1", srv.port))[1] for _ in range(3)]
        await asyncio.sleep(0.3)
        # 7 held: the 8th connection is still served
        engine.piece, engine.script = "", ["served"]
        r = await http.post(CHAT, json=MESSAGES)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "served"
        idle.append((await asyncio.open_connection("127.0.0.1", srv.port))[1])
        await asyncio.sleep(0.2)
        # 8 held: every probe answers, an API request gets 503 in OpenAI's shape
        for path in ("/health", "/metrics", "/version"):
            assert (await http.get(path)).status_code == 200, path
        r = await http.post(CHAT, json=MESSAGES)
        assert r.status_code == 503 and r.headers["connection"] == "close"
        assert r.json()["error"]["code"] == "too_many_connections"
        assert r.json()["error"]["type"] == "service_unavailable_error"
        metrics = (await http.get("/metrics")).text
        assert 'deltaserve:http_errors_total{model_name="scripted",status="503"} 1.0' in metrics
        for w in streams + idle:
            w.close()
        await asyncio.sleep(0.3)
        engine.script = ["again"]  # piece "" still: a whole reply
        r = await http.post(CHAT, json=MESSAGES)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "again"


# ---------------------------------------------------------------- the front ends' port
def reuse_port_listener(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT balances on Linux")
def test_the_front_ends_port_is_taken_once_and_never_shared_with_another_server() -> None:
    from deltaserve.server.front_ends import _listening_socket

    holder, listen, port = _listening_socket(ServerConfig(port=0))
    try:
        assert listen == f"port:{port}" and holder.getsockname()[1] == port > 0
        front = [reuse_port_listener(port) for _ in range(2)]  # what the front ends do
        for s in front:
            s.close()
    finally:
        holder.close()
    # a server of this user already listening with SO_REUSEPORT: "address in use", not a share
    other = reuse_port_listener(0)
    try:
        with pytest.raises(OSError) as e:
            _listening_socket(ServerConfig(port=other.getsockname()[1]))
        assert e.value.errno == errno.EADDRINUSE
    finally:
        other.close()
