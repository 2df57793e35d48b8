"""Serving one engine over HTTP: the listening socket, uvicorn (uvloop + httptools), the
connection gate and the drain. ``serve()`` starts the engine the config asks for, serves until
a signal and returns the exit code; ``BackgroundServer`` runs the same app inside a test or a
tool. ``server/cli.py`` parses the command line into the configs this takes;
``server/front_ends.py`` runs several of these processes around one core.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

from deltaserve.logs import get_logger
from deltaserve.server import cli_flags
from deltaserve.server.config import PROBE_RESERVE, ServerConfig

log = get_logger("deltaserve.server")

#: the exit code of a server whose engine core process died
CORE_DIED_EXIT = 1

#: after the drain deadline, how long the requests it aborted get to send their 503 / error frame
#: before uvicorn cancels what is left (a step of a long prefill on a CPU can take seconds)
DRAIN_GRACE_S = 10.0


def _uvicorn_server_class(*, signals: bool) -> type:
    """uvicorn's server with our drain: on shutdown, the app's requests still open after
    ``drain_timeout_s`` are ended by the app itself (``OpenAIServer.expire``: 503 JSON, an error
    frame and ``[DONE]`` on streams), so uvicorn's own cancellation never cuts one off. With
    ``signals`` the first SIGINT/SIGTERM drains and a second one forces the exit; the signal is
    not re-raised afterwards (the process exits 0). Without, no handler is installed (tests,
    embedding: ``should_exit`` drains)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config, drain_timeout_s: float) -> None:
            super().__init__(config)
            self.drain_timeout_s = drain_timeout_s

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            app_server = getattr(getattr(self.config.app, "state", None), "server", None)
            expire = getattr(app_server, "expire", None)
            timer = None
            if expire is not None:
                timer = asyncio.get_running_loop().call_later(self.drain_timeout_s, expire)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if not signals:
                yield
                return
            loop = asyncio.get_running_loop()
            installed = []
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / platform
                    pass
            try:
                yield
            finally:
                for sig in installed:
                    loop.remove_signal_handler(sig)

        def _on_signal(self, sig: int) -> None:
            if self.should_exit:
                log.warning("server.force_exit", signal=signal.Signals(sig).name)
                self.force_exit = True
            else:
                log.info("server.draining", signal=signal.Signals(sig).name)
                self.should_exit = True

    return DrainingServer


def uvicorn_config(app: Any, config: ServerConfig, drain_timeout_s: float, *, keep_alive_s: int) -> Any:
    """uvicorn's settings for ``app``: httptools with our read deadlines, room after the drain
    for the requests it aborts to answer, and a connection limit ``PROBE_RESERVE`` above
    ``max_connections``: the app's own gate refuses all but the probes past ``max_connections``
    (``app.ConnectionLimit``), so a full server still answers ``/health`` and ``/metrics``."""
    import uvicorn

    from deltaserve.server.read_timeouts import protocol_class

    cli_flags.uvicorn_logging(config.uvicorn_log_level)
    return uvicorn.Config(
        app,
        http=protocol_class(config.header_timeout_s, config.body_timeout_s),
        lifespan="on",
        log_config=None,
        access_log=config.access_log,
        timeout_graceful_shutdown=drain_timeout_s + DRAIN_GRACE_S,
        timeout_keep_alive=keep_alive_s,
        limit_concurrency=config.max_connections + PROBE_RESERVE if config.max_connections else None,
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
        ssl_ca_certs=config.ssl_ca_certs,
        root_path=config.root_path,
        log_level=config.uvicorn_log_level,
    )


def arm_connection_gate(app: Any, server: Any, max_connections: int) -> None:
    """Arm ``app``'s connection gate (``create_app``'s) with ``max_connections`` of ``server``'s
    open connections."""
    gate = getattr(getattr(app, "state", None), "connection_gate", None)
    if gate is not None:
        connections = server.server_state.connections
        gate.arm(lambda: len(connections), max_connections)


def bind_socket(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port), listening unless ``listen`` is false.
    ``reuse_port``: ``SO_REUSEPORT``, so other sockets of this user may bind the same port and
    the kernel spreads new connections over those that listen (``front_ends.py``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        if listen:
            # listen now: the URL is printed before uvicorn starts accepting, and a client that
            # connects in between waits in the backlog instead of being refused
            sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class BackgroundServer:
    """An app served by uvicorn as a task of the running event loop, on ``host`` and a free port
    (or ``port``); for tests and embedding. No signal handlers are installed.

    ::

        async with BackgroundServer(create_app(engine)) as srv:
            client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="none")
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        drain_timeout_s: float = 5.0,
        config: ServerConfig | None = None,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.drain_timeout_s = drain_timeout_s
        self.config = config or ServerConfig()  # its timeouts and limits (host, port, drain: above)
        self.server: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> BackgroundServer:
        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn_config(self.app, self.config, self.drain_timeout_s, keep_alive_s=5)
        self.server = _uvicorn_server_class(signals=False)(config, self.drain_timeout_s)
        arm_connection_gate(self.app, self.server, self.config.max_connections)
        self._task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("server stopped during startup")
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self._task is not None:
            await self._task


def build_engine(engine_config: Any, address: str | None = None) -> Any:
    """The ``AsyncEngine`` over the core ``engine.core_process`` asks for (``auto``: a process of
    its own; joining the one at ``address`` if given)."""
    from deltaserve.engine.config import CoreProcess
    from deltaserve.engine.front.async_engine import AsyncEngine, placement_client

    if engine_config.engine.core_process is CoreProcess.AUTO:
        engine_config = engine_config.replace(**{"engine.core_process": "separate"})
    return AsyncEngine(engine_config, client=placement_client(engine_config, address=address))


async def serve(
    engine_config: Any,
    server_config: ServerConfig,
    *,
    out: Any = None,
    sock: socket.socket | None = None,
    address: str | None = None,
    app_hook: Callable[[Any], None] | None = None,
) -> int:
    """Start the engine, serve until a signal, drain, shut down. Returns the exit code
    (``CORE_DIED_EXIT`` when a separate engine core process died). ``sock``: a bound socket to
    serve on, made to listen once the engine has started (else one is bound then); ``address``:
    join that engine core process; ``app_hook``: called with the app before it serves."""
    from deltaserve.server.app import create_app

    out = out or sys.stdout
    engine = build_engine(engine_config, address)
    await engine.start()
    state: dict[str, Any] = {"server": None, "code": 0}

    def core_died(message: str) -> None:
        # the streams have ended with an error and /health answers 503: drain what is left, exit
        print(f"deltaserve: error: {message}", file=sys.stderr, flush=True)
        state["code"] = CORE_DIED_EXIT
        if state["server"] is not None:
            state["server"].should_exit = True

    if engine.core is None:  # a core process of its own (an in-process one dies with the loop)
        engine.on_core_death.append(core_died)
    try:
        sock = sock or bind_socket(server_config.host, server_config.port)
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.listen(2048)  # taken before the model loaded: clients were refused until now
        host, port = sock.getsockname()[:2]
        app = create_app(engine, server_config)
        if app_hook is not None:
            app_hook(app)
        names = app.state.server.model_names
        shown = f"[{host}]" if ":" in host else host
        capacity = engine.model_info.capacity
        url = f"{server_config.scheme}://{shown}:{port}/v1"
        if address is None:  # a front end joining a core: its supervisor warns once for all
            cli_flags.warn_open_host(server_config)
        print(f"deltaserve: serving {names[0]} at {url} (OpenAI-compatible)", file=out)
        print(
            "deltaserve: capacity " + " ".join(f"{k}={v}" for k, v in capacity.items()), file=out, flush=True
        )
        config = uvicorn_config(app, server_config, server_config.drain_timeout_s, keep_alive_s=30)
        server = _uvicorn_server_class(signals=True)(config, server_config.drain_timeout_s)
        arm_connection_gate(app, server, server_config.max_connections)
        state["server"] = server
        if state["code"]:  # the core died while the app was being built
            server.should_exit = True
        await server.serve(sockets=[sock])
    finally:
        await engine.shutdown()
    print("deltaserve: stopped", file=out, flush=True)
    return int(state["code"])
