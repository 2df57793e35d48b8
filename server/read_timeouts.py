"""Read timeouts for uvicorn's HTTP/1.1 protocol (httptools), which has none of its own.

A client must send a request's headers within ``header_timeout_s`` of the connection opening (or
of the previous response, on a keep-alive connection: uvicorn's keep-alive timeout covers the
idle gap before the first byte), and its body within ``body_timeout_s`` of the headers. Past
either deadline the connection is closed: a client that trickles bytes (slowloris) cannot hold a
connection, a task and the memory of a half-read body for as long as it likes. A request whose
app already runs sees the close as a disconnect (it is aborted, and counted as a client
disconnect, not as a server error).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from deltaserve.logs import get_logger

log = get_logger("deltaserve.server")


class ReadTimeoutProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with header and body read deadlines (module docstring); subclass it
    with the two timeouts set (``protocol_class``)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(seconds, self._timed_out, what)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _timed_out(self, what: str) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            log.info("server.read_timeout", waiting_for=what, client=str(self.client))
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.header_timeout_s, "headers")

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.body_timeout_s, "body")

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()


def protocol_class(header_timeout_s: float, body_timeout_s: float) -> type[ReadTimeoutProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with these deadlines."""
    return type(
        "ReadTimeoutProtocol",
        (ReadTimeoutProtocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )
