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
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from deltaserve.engine.byte_size import bytes_arg
from deltaserve.engine.errors import ConfigError
from deltaserve.logs import configure_logging, get_logger
from deltaserve.server import cli_flags
from deltaserve.server.cli_flags import address_error, package_version
from deltaserve.server.config import API_KEY_ENV, ServerConfig, api_key_from, str_list
from deltaserve.server.reasoning import ReasoningParserName
from deltaserve.server.serving import bind_socket, serve
from deltaserve.server.store_cmd import add_store_parser, store_main
from deltaserve.server.tool_parsers import ToolParserName

log = get_logger("deltaserve.server")

#: ``serve`` options that set an engine config key: option dest -> dotted key
SHORTHANDS = {
    "tokenizer": "model.tokenizer",
    "dtype": "model.dtype",
    "device": "model.device",
    "max_model_len": "model.max_model_len",
    "gpu_memory_utilization": "cache.gpu_memory_utilization",
    "remote_cache": "cache.remote",
}


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
    s.add_argument(
        "--remote-cache", default=None, metavar="URL",
        help="cache.remote: mooncake://HOST:PORT of a Mooncake Store master (`deltaserve store`) the "
        "replicas share as a cache tier (docs/cache.md, docs/cluster.md)",
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
    add_store_parser(sub)
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
    if args.command == "store":
        return store_main(args)
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
