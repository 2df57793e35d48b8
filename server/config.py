"""ServerConfig: the HTTP side of ``deltaserve serve`` (the engine keeps its own EngineConfig).

Set from the command line (``deltaserve serve --host ... --port ...``) or built in code for
``create_app``. Validated on construction like the engine's config sections.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Annotated

import msgspec

from deltaserve.engine.byte_size import parse_bytes
from deltaserve.engine.errors import ConfigError
from deltaserve.server.reasoning import ReasoningParserName
from deltaserve.server.tool_parsers import ToolParserName

#: where ``deltaserve serve`` reads the API key when ``--api-key`` is not given
API_KEY_ENV = "DELTASERVE_API_KEY"

#: connections past ``max_connections`` on which the probes (``/health``, ``/metrics``,
#: ``/version``) are still served; beyond that uvicorn answers every request 503
PROBE_RESERVE = 64

#: the smallest body limit sized from the model, and the bytes per token of ``max_model_len``
MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 32


def body_limit(config: ServerConfig, max_model_len: int) -> int:
    """The request body limit in bytes (``max_body_bytes``, or sized from ``max_model_len``)."""
    return config.max_body_bytes or max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


class ServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the server listens and names its model.

    host / port
        Where uvicorn listens (``127.0.0.1:8000`` here; ``deltaserve serve``'s default host is
        ``0.0.0.0``, every interface, as vLLM's; port 0: any free port).
    served_model_names
        The names clients may send as ``model``; the first is reported by ``/v1/models`` and in
        responses. Default: the engine's ``model.path`` (``builtin:tiny-qwen3.5``). A request
        whose ``model`` is none of them gets a 404; an absent ``model`` means the first.
    drain_timeout_s
        On SIGINT/SIGTERM the server stops accepting connections and waits this long for
        in-flight requests to finish; what is left is aborted and answered: 503
        ``engine_shutdown`` in JSON, or on a stream an error frame and ``[DONE]``. A second
        signal exits at once.
    access_log
        uvicorn's per-request access log lines (off: they cost time per request).
    max_body_bytes
        The largest request body read; a larger one is answered 413 before it is read (by its
        ``Content-Length``, or as soon as a chunked body passes the limit). 0: sized from the
        model, ``max(1 MiB, 32 bytes x max_model_len)`` (room for a full-length prompt as text or
        token ids, with JSON escaping). An int or a size with a unit (``"4MiB"``; docs/config.md).
    header_timeout_s / body_timeout_s
        A client must send a request's headers within ``header_timeout_s`` of connecting (or of
        its first byte on a kept-alive connection) and its body within ``body_timeout_s`` of the
        headers, or the connection is closed (``server/read_timeouts.py``).
    max_connections
        Connections (and requests) served at once: past it, a request gets 503 in OpenAI's
        error shape and its connection is closed, except the probes (``/health``, ``/metrics``,
        ``/version``), which are served up to ``PROBE_RESERVE`` connections more
        (``app.ConnectionLimit``). 0: no limit.
    api_key
        When set, every route but ``/health``, ``/metrics`` and ``/version`` needs the header
        ``Authorization: Bearer <api_key>`` (compared in constant time); otherwise 401 in
        OpenAI's error shape (``server/auth.py``). None: no key is asked for. A key that is
        empty, has surrounding whitespace or characters a header cannot carry is refused (a
        ConfigError, never a server that runs without the key or can never match it).
    allowed_origins / allowed_methods / allowed_headers / allow_credentials
        CORS (vLLM's option names): with ``allowed_origins`` non-empty (``["*"]``: any origin),
        browsers' preflight ``OPTIONS`` requests are answered and responses carry the
        ``Access-Control-Allow-*`` headers. Empty (the default): no CORS headers, and a
        preflight is a 405 like any other unrouted method. ``"*"`` with ``allow_credentials``
        is refused: browsers reject ``*`` with credentials, and answering every origin by name
        instead would let any web page call the API with the user's credentials; list the
        origins. A listed origin is matched exactly (``"null"`` only when listed).
    tool_call_parser
        How chat replies are read for tool calls: ``qwen3_xml`` (``<function=NAME>`` blocks:
        Qwen3.5, Qwen3-Coder), ``hermes`` (JSON blocks: Qwen2.5 / Qwen3 / Qwen3-Next), ``none``;
        ``auto``: ``qwen3_xml`` if the chat template writes ``<function=``, else ``hermes``.
    reasoning_parser
        ``qwen3``: ``<think>`` text becomes ``reasoning_content``; ``none``: it stays content;
        ``auto``: ``qwen3`` if the chat template writes ``<think>``.
    ssl_keyfile / ssl_certfile / ssl_ca_certs
        TLS (vLLM's option names, passed to uvicorn): with ``ssl_certfile`` (PEM, the key in it
        or in ``ssl_keyfile``) the server speaks https; ``ssl_ca_certs`` verifies client
        certificates. A file that is not there, or a key without a certificate, is refused.
    root_path
        The path prefix a reverse proxy strips before forwarding (uvicorn's ``root_path``,
        vLLM's ``--root-path``): "" or ``/prefix`` (no trailing ``/``).
    uvicorn_log_level
        uvicorn's own log level (``critical`` ... ``trace``); None: uvicorn's default.
    """

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    served_model_names: list[str] = []
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    access_log: bool = False
    max_body_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    max_connections: Annotated[int, msgspec.Meta(ge=0)] = 1024
    tool_call_parser: ToolParserName = ToolParserName.AUTO
    reasoning_parser: ReasoningParserName = ReasoningParserName.AUTO
    api_key: str | None = None
    allowed_origins: list[str] = []
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    root_path: str = ""
    uvicorn_log_level: str | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def __repr__(self) -> str:  # the key must not reach a log line through a repr
        def shown(name: str) -> str:
            return "'***'" if name == "api_key" and self.api_key else repr(getattr(self, name))

        fields = ", ".join(f"{f}={shown(f)}" for f in self.__struct_fields__)
        return f"ServerConfig({fields})"

    def __post_init__(self) -> None:
        if isinstance(self.max_body_bytes, str):  # "4MiB": the engine's size parser and units
            self.max_body_bytes = parse_bytes(self.max_body_bytes, "server.max_body_bytes")
        if not isinstance(self.host, str) or not self.host.strip():
            # an empty host binds every interface: never the result of an unset variable
            raise ConfigError(f"server.host = {self.host!r}: must name an address (0.0.0.0: every interface)")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port = {self.port!r}: must be an integer in [0, 65535]")
        if not (isinstance(self.drain_timeout_s, (int, float)) and self.drain_timeout_s >= 0):
            raise ConfigError(f"server.drain_timeout_s = {self.drain_timeout_s!r}: must be a number >= 0")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"server.{name} = {value!r}: must be a number > 0")
        if not isinstance(self.max_connections, int) or self.max_connections < 0:
            raise ConfigError(f"server.max_connections = {self.max_connections!r}: must be an integer >= 0")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 0:
            raise ConfigError(f"server.max_body_bytes = {self.max_body_bytes!r}: must be an integer >= 0")
        for name, kind in (("tool_call_parser", ToolParserName), ("reasoning_parser", ReasoningParserName)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                try:
                    setattr(self, name, kind(value))
                except ValueError:
                    choices = [k.value for k in kind]
                    raise ConfigError(f"server.{name} = {value!r}: must be one of {choices}") from None
        if not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ConfigError(f"server.served_model_names = {self.served_model_names!r}: non-empty strings")
        self._check_access()
        self._check_uvicorn()

    def _check_uvicorn(self) -> None:
        """TLS files, the root path and uvicorn's log level: refused here, before the model loads."""
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            value = getattr(self, name)
            if value is not None and not os.path.isfile(value):
                raise ConfigError(f"server.{name} = {value!r}: no such file (--{name.replace('_', '-')})")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ConfigError("server.ssl_keyfile without server.ssl_certfile: give --ssl-certfile too")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigError(f"server.root_path = {self.root_path!r}: '' or '/prefix' (no trailing '/')")
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        if self.uvicorn_log_level is not None and self.uvicorn_log_level not in levels:
            raise ConfigError(f"server.uvicorn_log_level = {self.uvicorn_log_level!r}: one of {list(levels)}")

    def _check_access(self) -> None:
        """The key and CORS: refuse what would serve more openly than asked."""
        if self.api_key is not None:
            check_api_key(self.api_key, "server.api_key")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not all(isinstance(v, str) and v.strip() for v in value):
                raise ConfigError(f"server.{name} = {value!r}: non-empty strings")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ConfigError(
                "server.allow_credentials (--allow-credentials) with '*' in server.allowed_origins "
                "(--allowed-origins): any web page could call the API with its users' credentials "
                "(browsers refuse '*' with credentials); list the origins allowed instead"
            )


def check_api_key(key: object, name: str) -> None:
    """Raise a one-line ``ConfigError`` naming ``name`` (never the key) unless ``key`` is a usable
    bearer key: non-empty, printable ASCII (what a header carries), no surrounding whitespace
    (``auth.key_matches`` strips the token a client sends, so such a key could never match)."""
    if not isinstance(key, str) or not key.strip():
        raise ConfigError(f"{name} is empty: give a key, or leave it unset for no key")
    if key != key.strip():
        raise ConfigError(f"{name} has leading or trailing whitespace: no client could send it")
    if not (key.isascii() and key.isprintable()):
        raise ConfigError(f"{name} has characters an HTTP header cannot carry: printable ASCII only")


def str_list(values: list[str] | None, option: str) -> list[str] | None:
    """The items of a list option: each value a JSON list or comma-separated (vLLM passes JSON)."""
    if values is None:
        return None
    out: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                items = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{option} {value!r}: not a JSON list ({e})") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ConfigError(f"{option} {value!r}: must be a list of strings")
        else:
            items = [v.strip() for v in value.split(",")]
        if not all(isinstance(i, str) and i.strip() for i in items):
            # an empty entry is a slip (a trailing comma, an unset variable): never dropped quietly
            raise ConfigError(f"{option} {value!r}: an empty entry")
        out += items
    return out


def api_key_from(option: str | None, env: Mapping[str, str]) -> str | None:
    """The API key of ``--api-key`` or ``$DELTASERVE_API_KEY``; None when neither is set. A key
    given but empty (or unusable: ``config.check_api_key``) is a ``ConfigError``, never no key;
    so are the two given with different keys (which one guards the server would be a guess)."""
    from_env = env.get(API_KEY_ENV)
    if option is not None:
        check_api_key(option, "--api-key")
    if from_env is not None:
        check_api_key(from_env, f"${API_KEY_ENV}")
    if option is not None and from_env is not None and option != from_env:
        raise ConfigError(f"--api-key and ${API_KEY_ENV} are both set, to different keys: give one")
    return option if option is not None else from_env
