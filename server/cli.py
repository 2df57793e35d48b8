"""``deltaserve serve``: the OpenAI-compatible server on uvicorn (uvloop + httptools).

::

    deltaserve serve                                  # the built-in tiny model on 127.0.0.1:8000
    deltaserve serve --config serve.toml --set scheduler.policy=lpm --port 9000
    python -m deltaserve serve --served-model-name qwen --host 0.0.0.0

Startup loads the model, prints the URL and the planned capacity (``EngineCore.capacity``) on
stdout, then serves. SIGINT / SIGTERM drain: no new connections, in-flight requests get up to
``--drain-timeout`` seconds to finish, what is left is aborted, and the process exits 0. A
second signal exits at once (still 0: leftovers are aborted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from deltaserve.engine.errors import ConfigError
from deltaserve.logs import configure_logging, get_logger
from deltaserve.server.config import ServerConfig
from deltaserve.server.reasoning import ReasoningParserName
from deltaserve.server.tool_parsers import ToolParserName

log = get_logger("deltaserve.server")


def build_parser(
    extra_args: Sequence[Callable[[argparse.ArgumentParser], None]] = (),
) -> argparse.ArgumentParser:
    """The command line; each of ``extra_args`` adds options to ``serve`` (the package's entry
    point adds the cluster's ``--replicas``, which this package does not know of)."""
    from deltaserve.engine.cli import add_config_args

    parser = argparse.ArgumentParser(
        prog="deltaserve", description="deltaserve: hybrid GDN + attention LLM serving"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default %(default)s; 0: any free port)")
    s.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="name(s) clients use as `model` (repeatable; default: the config's model.path)",
    )
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGINT/SIGTERM, wait up to S seconds for in-flight requests (default %(default)s)",
    )
    s.add_argument("--access-log", action="store_true", help="uvicorn access log lines on stderr")
    s.add_argument(
        "--header-timeout", type=float, default=10.0, metavar="S",
        help="close a connection whose request headers take longer than S seconds (default %(default)s)",
    )  # fmt: skip
    s.add_argument(
        "--body-timeout", type=float, default=30.0, metavar="S",
        help="close a connection whose request body takes longer than S seconds (default %(default)s)",
    )  # fmt: skip
    s.add_argument(
        "--max-connections", type=int, default=1024, metavar="N",
        help="connections served at once; more get 503 (default %(default)s; 0: no limit)",
    )  # fmt: skip
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=0,
        metavar="B",
        help="request bodies over B bytes get 413 before they are read (default 0: max(1 MiB, 32 x max_model_len))",
    )
    s.add_argument("--log-level", default="info", help="deltaserve log level on stderr (default %(default)s)")
    # how chat replies are parsed (server/output_parser.py)
    s.add_argument(
        "--tool-call-parser", default="auto", choices=[n.value for n in ToolParserName],
        help="tool calls in chat replies (default auto: from the chat template)",
    )  # fmt: skip
    s.add_argument(
        "--reasoning-parser", default="auto", choices=[n.value for n in ReasoningParserName],
        help="<think> reasoning as reasoning_content (default auto: from the chat template)",
    )  # fmt: skip
    for add in extra_args:
        add(s)
    return parser


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
    """uvicorn's settings for ``app``: httptools with our read deadlines, the connection limit,
    and room after the drain for the requests it aborts to answer."""
    import uvicorn

    from deltaserve.server.read_timeouts import protocol_class

    return uvicorn.Config(
        app,
        http=protocol_class(config.header_timeout_s, config.body_timeout_s),
        lifespan="on",
        log_config=None,
        access_log=config.access_log,
        timeout_graceful_shutdown=drain_timeout_s + DRAIN_GRACE_S,
        timeout_keep_alive=keep_alive_s,
        limit_concurrency=config.max_connections or None,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # listen now: the URL is printed before uvicorn starts accepting, and a client that connects
    # in between waits in the backlog instead of being refused
    sock.listen(2048)
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


async def serve(engine_config: Any, server_config: ServerConfig, *, out: Any = None) -> int:
    """Start the engine, serve until a signal, drain, shut down. Returns the exit code."""

    from deltaserve.engine import AsyncEngine
    from deltaserve.server.app import create_app

    out = out or sys.stdout
    engine = AsyncEngine(engine_config)
    await engine.start()
    try:
        sock = bind_socket(server_config.host, server_config.port)
        host, port = sock.getsockname()[:2]
        app = create_app(engine, server_config)
        names = app.state.server.model_names
        shown = f"[{host}]" if ":" in host else host
        capacity = engine.model_info.capacity
        print(f"deltaserve: serving {names[0]} at http://{shown}:{port}/v1 (OpenAI-compatible)", file=out)
        print(
            "deltaserve: capacity " + " ".join(f"{k}={v}" for k, v in capacity.items()), file=out, flush=True
        )
        config = uvicorn_config(app, server_config, server_config.drain_timeout_s, keep_alive_s=30)
        server = _uvicorn_server_class(signals=True)(config, server_config.drain_timeout_s)
        await server.serve(sockets=[sock])
    finally:
        await engine.shutdown()
    print("deltaserve: stopped", file=out, flush=True)
    return 0


#: another way to serve the parsed command (``deltaserve.__main__``: replicas on Ray Serve):
#: ``(args, engine config, server config) -> exit code``, or None to serve one engine here
Dispatch = Callable[[argparse.Namespace, Any, ServerConfig], int | None]


def main(
    argv: Sequence[str] | None = None,
    *,
    extra_args: Sequence[Callable[[argparse.ArgumentParser], None]] = (),
    dispatch: Dispatch | None = None,
) -> int:
    parser = build_parser(extra_args)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    from deltaserve.engine import install_uvloop
    from deltaserve.engine.cli import config_from_args

    try:
        engine_config = config_from_args(args)
        server_config = ServerConfig(
            host=args.host,
            port=args.port,
            served_model_names=list(args.served_model_name),
            drain_timeout_s=args.drain_timeout,
            access_log=args.access_log,
            max_body_bytes=args.max_body_bytes,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            max_connections=args.max_connections,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        )
    except ConfigError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    if dispatch is not None:
        code = dispatch(args, engine_config, server_config)
        if code is not None:
            return code
    install_uvloop()
    try:
        return asyncio.run(serve(engine_config, server_config))
    except ConfigError as e:  # raised by the engine at start (e.g. no CUDA device)
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the address is in use, ...
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 1
