"""The API key check: an ASGI middleware in front of the routes when ``ServerConfig.api_key`` is set.

Every request needs ``Authorization: Bearer <key>`` except those to ``OPEN_PATHS`` (health
checks and Prometheus scrapes come from machines that hold no key; ``/version`` reveals
nothing) and CORS preflights (``OPTIONS``: browsers never send credentials on them; the CORS
middleware in front answers them). A missing or wrong key gets 401 in OpenAI's error shape with
``WWW-Authenticate: Bearer``; the key given is never echoed. The comparison is
``hmac.compare_digest`` over bytes, so its time does not depend on how much of the key matched.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from deltaserve.server.errors import APIError

#: reachable without a key
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
JSON = "application/json"


def route_path(scope: Any) -> str:
    """The request's path without uvicorn's ``root_path`` (``--root-path``: uvicorn puts the
    prefix in front of ``path``), as Starlette's router matches it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


def key_matches(header: bytes, key: bytes) -> bool:
    """True when ``header`` is ``Bearer <key>`` (the scheme in any case), compared in constant time."""
    scheme, _, token = header.partition(b" ")
    # compare_digest runs even on a wrong scheme, so a reply's time says nothing about the key
    same = hmac.compare_digest(token.strip(), key)
    return same and scheme.lower() == b"bearer"


def _unauthorized(header: bytes) -> APIError:
    if not header:
        message = "no API key provided: send the header 'Authorization: Bearer <key>'"
    else:
        message = "incorrect API key provided"
    return APIError(401, message, "invalid_request_error", None, "invalid_api_key")


class BearerAuth:
    """ASGI middleware: 401 for a request to a guarded path without the right bearer key."""

    def __init__(self, app: Any, api_key: str, on_reject: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self._key = api_key.encode()
        self._on_reject = on_reject

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
        if key_matches(header, self._key):
            await self.app(scope, receive, send)
            return
        self._on_reject()
        err = _unauthorized(header)
        response = Response(
            err.body(), status_code=err.status, media_type=JSON, headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)
