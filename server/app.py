"""The OpenAI-compatible ASGI app over one ``EngineClient``: Starlette routing, msgspec schemas.

``create_app(engine, config)`` serves:

* ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as SSE, ``n``,
  logprobs, tools), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
  ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics`` (Prometheus, a
  registry per app).

In front of the routes: CORS (when ``allowed_origins`` is set; outermost, so a preflight, a
503 and a 401 all carry its headers), then the connection limit (``ConnectionLimit``), then
the API key check (``auth.py``, when ``api_key`` is set).

The connection limit is the app's, not uvicorn's, so the probes outlive it: past
``max_connections`` open connections (or requests in flight), a request gets 503 in OpenAI's
shape with ``Connection: close``, but ``/health``, ``/metrics`` and ``/version`` are still
served; uvicorn's own ``limit_concurrency`` sits ``PROBE_RESERVE`` higher (``cli.py``). The
gate learns the limit and the open connections from the server that runs the app
(``ConnectionGate.arm``: ``serve`` and ``BackgroundServer`` do, with their ``ServerConfig``'s
``max_connections``); unarmed (another ASGI server, Ray Serve) it passes everything, as
uvicorn without a limit would.

The rooms: ``handlers.py`` (the endpoints), ``chat.py`` / ``completions.py`` (responses and
stream chunks), ``sse.py`` (SSE, disconnects, the one stream skeleton), ``inputs.py`` (API
fields -> engine inputs), ``tracker.py`` (per-request bookkeeping and latency metrics),
``errors.py`` (OpenAI's error shape; 4xx for client mistakes, never a traceback), ``auth.py``
(the API key), ``unsupported.py`` (fields accepted in shape but not implemented).

Why Starlette and not FastAPI: the schemas are msgspec structs (the engine's own types are
msgspec, and msgspec decodes/validates and encodes several times faster than pydantic);
FastAPI would add pydantic models duplicating them, and its dependency injection, for
nothing this API needs. Starlette gives routing, request/response objects and lifespan with
a thin layer over ASGI.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from deltaserve.engine.front.client import EngineClient
from deltaserve.logs import get_logger
from deltaserve.server.auth import OPEN_PATHS, BearerAuth, route_path
from deltaserve.server.config import ServerConfig
from deltaserve.server.errors import APIError, encode, translate_error
from deltaserve.server.handlers import JSON, OpenAIServer

log = get_logger("deltaserve.server")


def _endpoint(handler: Callable[[Request], Awaitable[Response]], server: OpenAIServer) -> Callable:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ClientDisconnect:  # the client hung up while sending its body: nobody to answer
            server.metrics.client_disconnects.inc()
            log.info("server.client_disconnected", path=request.url.path)
            return Response(status_code=499)
        except Exception as e:
            err = translate_error(e)
            if err.status == 503:  # the engine is dead or shutting down: said once elsewhere
                log.warning("server.unavailable", path=request.url.path, error=err.message)
            elif err.status >= 500:
                log.error(
                    "server.request_failed", path=request.url.path, status=err.status, error=err.message
                )
            server.metrics.http_errors.labels(str(err.status)).inc()
            return Response(err.body(), status_code=err.status, media_type=JSON)

    return wrapped


def package_version() -> str:
    """The installed distribution's version; the source tree's ``__version__`` when not installed."""
    try:
        return importlib.metadata.version("deltaserve")
    except importlib.metadata.PackageNotFoundError:
        import deltaserve

        return deltaserve.__version__


class ConnectionGate:
    """What ``ConnectionLimit`` checks: a limit and the open connections, both from the server
    that runs the app (``arm``), and the non-probe requests in flight."""

    def __init__(self) -> None:
        self.limit = 0  # 0: no limit (not armed, or max_connections = 0)
        self.connections: Callable[[], int] = lambda: 0
        self.in_flight = 0

    def arm(self, connections: Callable[[], int], limit: int) -> None:
        """Refuse past ``limit`` (0: never) of ``connections()`` open connections (uvicorn's
        ``server_state.connections``) or requests in flight."""
        self.connections = connections
        self.limit = limit

    def full(self) -> bool:
        """True when one more request would pass the limit: the asking connection counts among
        the open ones, the asking request not yet among those in flight."""
        limit = self.limit
        return bool(limit) and (self.connections() > limit or self.in_flight >= limit)


class ConnectionLimit:
    """ASGI middleware: 503 (OpenAI's shape, ``Connection: close``) for a request while the gate
    is full, except to the probe paths (``auth.OPEN_PATHS``), which are always let through."""

    def __init__(self, app: Any, gate: ConnectionGate, on_reject: Callable[[], None]) -> None:
        self.app = app
        self.gate = gate
        self.on_reject = on_reject

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        gate = self.gate
        if gate.full():
            self.on_reject()
            message = f"the server is at its connection limit ({gate.limit}); retry later"
            body = APIError(503, message, "service_unavailable_error", None, "too_many_connections").body()
            headers = {"Connection": "close", "Retry-After": "1"}
            await Response(body, status_code=503, media_type=JSON, headers=headers)(scope, receive, send)
            return
        gate.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            gate.in_flight -= 1


def _middleware(config: ServerConfig, server: OpenAIServer, gate: ConnectionGate) -> list[Middleware]:
    """CORS outermost (its preflight answer and headers also cover a 503 and a 401), then the
    connection limit, then the key check."""
    stack = []
    if config.allowed_origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=config.allowed_origins,
                allow_methods=config.allowed_methods,
                allow_headers=config.allowed_headers,
                allow_credentials=config.allow_credentials,
            )
        )
    # (labels() creates the series: only when a 503 is given, so /metrics lists no 5xx before one)
    stack.append(
        Middleware(
            ConnectionLimit, gate=gate, on_reject=lambda: server.metrics.http_errors.labels("503").inc()
        )
    )
    if config.api_key:
        stack.append(
            Middleware(
                BearerAuth,
                api_key=config.api_key,
                on_reject=lambda: server.metrics.http_errors.labels("401").inc(),
            )
        )
    return stack


def create_app(engine: EngineClient, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app over ``engine``. If the engine is not started yet, the app's lifespan starts
    it and shuts it down; a started engine stays the caller's."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)
    owns_engine = not engine.started

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if owns_engine:
            await engine.start()
        try:
            yield
        finally:
            server.tokenizer.close()
            if owns_engine:
                await engine.shutdown()

    version_body = encode({"version": package_version()})

    async def version(request: Request) -> Response:
        return Response(version_body, media_type=JSON)

    def route(path: str, handler: Callable, methods: list[str]) -> Route:
        return Route(path, _endpoint(handler, server), methods=methods)

    routes = [
        route("/v1/chat/completions", server.chat, ["POST"]),
        route("/v1/completions", server.completions, ["POST"]),
        route("/v1/models", server.models, ["GET"]),
        route("/v1/models/{model_id:path}", server.retrieve_model, ["GET"]),
        route("/health", server.health, ["GET"]),
        route("/version", version, ["GET"]),
        route("/tokenize", server.tokenize, ["POST"]),
        route("/detokenize", server.detokenize, ["POST"]),
        route("/metrics", server.metrics_endpoint, ["GET"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(status, "invalid_request_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        server.metrics.http_errors.labels(str(status)).inc()
        body = APIError(status, message, kind, None, None).body()
        return Response(body, status_code=status, media_type=JSON, headers=getattr(exc, "headers", None))

    gate = ConnectionGate()
    app = Starlette(
        routes=routes,
        middleware=_middleware(config, server, gate),
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    app.state.server = server
    app.state.connection_gate = gate
    return app
