"""``deltaserve serve``: the OpenAI-compatible server on uvicorn (uvloop + httptools).

::

    deltaserve serve                                  # the built-in tiny model on 0.0.0.0:8000
    deltaserve serve /models/Qwen3.5-0.8B --max-model-len 32768 --gpu-memory-utilization 0.85
    deltaserve serve --config serve.toml --set scheduler.policy=lpm --port 9000
    python -m deltaserve serve --served-model-name qwen --host 127.0.0.1 --api-key "$KEY"
    deltaserve --version
    deltaserve export-tokenizer ./tiny-tokenizer      # the built-in model's tokenizer, for clients

``MODEL`` (or ``--model``), ``--tokenizer``, ``--dtype``, ``--device``, ``--max-model-len`` and
``--gpu-memory-utilization`` are shorthands of config keys (``SHORTHANDS``); they override the
``--config`` file, and ``--set`` overrides them. vLLM's and llama-server's flags are shorthands,
accepted or refused as the table in ``server/cli_flags.py`` says (docs/server.md, "From vLLM /
from llama-server").

The listening address is taken first (``--host`` defaults to every interface, as vLLM's): one
in use is one line and exit 2, before the model loads. Startup then loads the model, prints the URL and the planned capacity (``EngineCore.capacity``) on
stdout, then serves. SIGINT / SIGTERM drain: no new connections, in-flight requests get up to
``--drain-timeout`` seconds to finish, what is left is aborted, and the process exits 0. A
second signal exits at once (still 0: leftovers are aborted).

By default (``engine.core_process = "auto"``: ``separate`` here) the engine core runs in a process
of its own (``AsyncEngine`` over ``ProcCoreClient``, docs/server.md): if that process dies, open streams end with an error,
``/health`` answers 503, and the server drains and exits 1 (a supervisor restarts it).
``--in-process`` runs it on a thread of the server's process (``LocalCoreClient``).
``--api-server-count N`` (N > 1) runs N front-end processes around one core, sharing the port
(``server/front_ends.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from deltaserve.engine.byte_size import bytes_arg
from deltaserve.engine.errors import ConfigError
from deltaserve.logs import configure_logging, get_logger
from deltaserve.server import cli_flags
from deltaserve.server.cli_flags import address_error, package_version
from deltaserve.server.config import API_KEY_ENV, PROBE_RESERVE, ServerConfig, api_key_from, str_list
from deltaserve.server.reasoning import ReasoningParserName
from deltaserve.server.tool_parsers import ToolParserName

log = get_logger("deltaserve.server")

#: ``serve`` options that set an engine config key: option dest -> dotted key
SHORTHANDS = {
    "tokenizer": "model.tokenizer",
    "dtype": "model.dtype",
    "device": "model.device",
    "max_model_len": "model.max_model_len",
    "gpu_memory_utilization": "cache.gpu_memory_utilization",
}
#: the exit code of a server whose engine core process died
CORE_DIED_EXIT = 1


def _add_model_args(s: argparse.ArgumentParser) -> None:
    """The model and the shorthands of engine config keys."""
    s.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="model.path: builtin:<name> or a Hugging Face-format folder (default: the config's)",
    )  # fmt: skip
    s.add_argument("--model", "-m", default=None, help="the same as MODEL")
    s.add_argument("--tokenizer", default=None, help="model.tokenizer: a tokenizer folder or builtin:<name>")
    s.add_argument("--dtype", default=None, help="model.dtype: float32 | bfloat16 | float16 | auto")
    s.add_argument("--device", default=None, help="model.device: auto | cpu | cuda | cuda:N")
    s.add_argument("--max-model-len", type=int, default=None, metavar="N", help="model.max_model_len")
    s.add_argument(
        "--gpu-memory-utilization", type=float, default=None, metavar="F",
        help="cache.gpu_memory_utilization: share of the GPU's memory the engine may use (CUDA)",
    )  # fmt: skip
    core = s.add_mutually_exclusive_group()
    core.add_argument(
        "--engine-process", action="store_true",
        help="engine.core_process=separate (the default): the engine core in its own process (docs/server.md)",
    )  # fmt: skip
    core.add_argument(
        "--in-process", action="store_true",
        help="engine.core_process=in_process: the engine core on a thread of the server's process",
    )  # fmt: skip
    s.add_argument(
        "--api-server-count", type=int, default=1, metavar="N",
        help="N front-end processes (HTTP, tokenizing, detokenizing) share one engine core process "
        "(N > 1 implies --engine-process; default %(default)s)",
    )  # fmt: skip


def _add_http_args(s: argparse.ArgumentParser) -> None:
    """The API key and CORS."""
    s.add_argument(
        "--api-key", default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health, /metrics, /version "
        f"(default: ${API_KEY_ENV}, else no key)",
    )  # fmt: skip
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):  # fmt: skip
        s.add_argument(
            flag, action="append", default=None, metavar="LIST",
            help=f"CORS: allowed {what}, a JSON list or comma-separated (repeatable; '*': any)",
        )  # fmt: skip
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")


def build_parser(
    extra_args: Sequence[Callable[[argparse.ArgumentParser], None]] = (),
) -> argparse.ArgumentParser:
    """The command line; each of ``extra_args`` adds options to ``serve`` (the package's entry
    point adds the cluster's ``--replicas``, which this package does not know of)."""
    from deltaserve.engine.cli import add_config_args

    parser = argparse.ArgumentParser(
        prog="deltaserve", description="deltaserve: hybrid GDN + attention LLM serving"
    )
    parser.add_argument("--version", action="version", version=f"deltaserve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(s)
    _add_model_args(s)
    _add_http_args(s)
    s.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to listen on (default %(default)s: every interface, as vLLM's)",
    )
    s.add_argument("--port", type=int, default=8000, help="port (default %(default)s; 0: any free port)")
    s.add_argument(
        "--served-model-name",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="name(s) clients use as `model`, the first reported (one or several, repeatable; put MODEL "
        "before this option; default: the config's model.path)",
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
        help="connections served at once; past it requests get 503, but /health, /metrics and /version "
        "are still served (default %(default)s; 0: no limit)",
    )  # fmt: skip
    s.add_argument(
        "--max-body-bytes",
        type=bytes_arg,
        default=0,
        metavar="B",
        help="request bodies over B bytes get 413 before they are read (bytes or 4MiB; default 0: max(1 MiB, 32 x max_model_len))",
    )
    s.add_argument("--log-level", default="info", help="deltaserve log level on stderr (default %(default)s)")
    # how chat replies are parsed (server/output_parser.py)
    s.add_argument(
        "--tool-call-parser", default="auto",
        choices=[n.value for n in ToolParserName] + list(cli_flags.TOOL_PARSER_ALIASES),
        help="tool calls in chat replies (default auto: from the chat template; qwen3_coder: qwen3_xml)",
    )  # fmt: skip
    s.add_argument(
        "--reasoning-parser", default="auto", choices=[n.value for n in ReasoningParserName],
        help="<think> reasoning as reasoning_content (default auto: from the chat template)",
    )  # fmt: skip
    cli_flags.add_compat_args(s)
    for add in extra_args:
        add(s)
    e = sub.add_parser(
        "export-tokenizer",
        help="write a model's tokenizer (and chat template) to a folder clients can load",
        description="Writes the tokenizer files of MODEL (default: the built-in tiny model) to DIR, "
        "for clients that load the served model's tokenizer by path (AutoTokenizer.from_pretrained(DIR)).",
    )
    e.add_argument("dir", metavar="DIR", help="the folder to write (created if missing)")
    e.add_argument("--model", default="builtin:tiny-qwen3.5", help="builtin:<name> or a model folder")
    return parser


def engine_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The engine config keys the model argument and the shorthands set (only those given)."""
    models = {m for m in (args.model_tag, args.model) if m is not None}
    if len(models) > 1:
        raise ConfigError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ: give one")
    out: dict[str, object] = {"model.path": models.pop()} if models else {}
    out.update(cli_flags.engine_key_overrides(args, SHORTHANDS))
    if getattr(args, "in_process", False):
        if getattr(args, "api_server_count", 1) > 1:
            raise ConfigError("--api-server-count > 1 shares one engine core process: not with --in-process")
        out["engine.core_process"] = "in_process"
    elif getattr(args, "engine_process", False) or getattr(args, "api_server_count", 1) > 1:
        out["engine.core_process"] = "separate"
    return out


def server_config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ServerConfig:
    """The ``ServerConfig`` of a parsed ``serve`` command (``env``: where ``API_KEY_ENV`` is read)."""
    env = os.environ if env is None else env
    cors: dict[str, object] = {}
    for dest, option in (("allowed_origins", "--allowed-origins"), ("allowed_methods", "--allowed-methods"),
                         ("allowed_headers", "--allowed-headers")):  # fmt: skip
        items = str_list(getattr(args, dest), option)
        if items is not None:
            cors[dest] = items
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_names=list(args.served_model_name),
        drain_timeout_s=args.drain_timeout,
        access_log=args.access_log,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        api_key=api_key_from(args.api_key, env),
        allow_credentials=args.allow_credentials,
        tool_call_parser=cli_flags.tool_parser_name(args.tool_call_parser),
        reasoning_parser=args.reasoning_parser,
        **cors,  # type: ignore[arg-type]
        **cli_flags.server_overrides(args),  # type: ignore[arg-type]
    )


def export_tokenizer(model: str, out_dir: str | os.PathLike) -> Path:
    """Write ``model``'s tokenizer files (``builtin:<name>`` or a folder) to ``out_dir``."""
    from transformers import AutoTokenizer

    from deltaserve.models.builtin import ensure_builtin_model

    prefix = "builtin:"
    folder = ensure_builtin_model(model[len(prefix) :]) if model.startswith(prefix) else Path(model)
    if not folder.is_dir():
        raise ConfigError(f"--model {model!r}: no such folder")
    out = Path(out_dir)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out


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
    if args.command == "export-tokenizer":
        return _export_main(args)
    configure_logging(args.log_level)
    from deltaserve.engine import install_uvloop
    from deltaserve.engine.cli import config_from_args

    try:
        engine_config = config_from_args(args, engine_overrides(args))
        server_config = server_config_from_args(args)
    except ConfigError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    if args.api_server_count < 1:
        print(
            f"deltaserve: error: --api-server-count must be >= 1, got {args.api_server_count}",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "replicas", None) and (server_config.api_key or server_config.allowed_origins):
        # the replicas' ingress is built by deltaserve.cluster from the served names alone: refuse
        # rather than serve without the key or the CORS policy the command asked for
        print(
            "deltaserve: error: --api-key and the CORS options are not applied with --replicas",
            file=sys.stderr,
        )
        return 2
    host, port = server_config.host, server_config.port
    replicas = bool(getattr(args, "replicas", None))
    sock = None
    try:
        # the address first: one in use is found before the model loads (the front ends'
        # supervisor takes it first too); not listening yet, so clients are refused, not held
        if args.api_server_count == 1 or replicas:
            sock = bind_socket(host, port, listen=False)
        cli_flags.log_start(args)
        if replicas:  # the cluster prints its own address
            cli_flags.warn_open_host(server_config)
        if dispatch is not None:
            if replicas and sock is not None:  # the cluster binds the address itself
                sock.close()
                sock = None
            code = dispatch(args, engine_config, server_config)
            if code is not None:
                return code
        install_uvloop()
        if args.api_server_count > 1:
            from deltaserve.server.front_ends import serve_front_ends

            return serve_front_ends(engine_config, server_config, args.api_server_count)
        return asyncio.run(serve(engine_config, server_config, sock=sock))
    except ConfigError as e:  # raised by the engine at start (e.g. no CUDA device)
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        line = address_error(e, host, port)
        print(line or f"deltaserve: error: {e}", file=sys.stderr)
        return 2 if line else 1
    finally:
        if sock is not None:
            sock.close()


def _export_main(args: argparse.Namespace) -> int:
    try:
        out = export_tokenizer(args.model, args.dir)
    except (ConfigError, ValueError, OSError) as e:  # ValueError: an unknown built-in name
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    print(f"deltaserve: wrote the tokenizer of {args.model} to {out}")
    return 0
