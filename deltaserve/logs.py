"""Logging: structlog events delivered to the standard ``logging`` module.

The library never configures logging and never writes to stdout. Every module logs with
``get_logger("deltaserve.<part>")``: a structlog logger whose events become ordinary
``logging`` records on the stdlib logger of that name, so the *application's* logging
configuration (handlers, levels, formatters) decides what is shown and where. Without any
configuration Python's last-resort handler prints warnings and errors to stderr.

A record's message is ``event key=value ...`` (readable in a plain handler); the event
name and its fields are also attached as ``record.event`` and ``record.fields`` for
structured handlers. The engine applies ``logging.level`` to the ``deltaserve`` logger.

Tools (and applications that want our format) call ``configure_logging(level)``: one
stderr handler on the ``deltaserve`` logger.

This module imports nothing from deltaserve, so every part (torch-free ones included) can use it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

ROOT_LOGGER = "deltaserve"
_STACKLEVEL = 4


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return repr(text) if (not text or any(c.isspace() for c in text) or "=" in text) else text


def _to_stdlib(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[Any, ...], dict]:
    """Last processor: the (args, kwargs) of the stdlib ``Logger`` call."""
    exc_info = event_dict.pop("exc_info", None)
    event = str(event_dict.pop("event", ""))
    fields = dict(event_dict)
    message = " ".join([event, *(f"{k}={_format_value(v)}" for k, v in fields.items())])
    # stacklevel: the record names the caller of ``log.info(...)``, not structlog's frames
    return (message,), {
        "exc_info": exc_info,
        "extra": {"event": event, "fields": fields},
        "stacklevel": _STACKLEVEL,
    }


def get_logger(name: str) -> Any:
    """A structlog logger for ``name`` (``deltaserve.<part>``) that logs through stdlib ``logging``.

    It does not depend on ``structlog.configure``: an application's own structlog setup
    neither breaks nor redirects the library's records.
    """
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[structlog.stdlib.filter_by_level, _to_stdlib],
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def set_level(level: str) -> None:
    """Set the level of every ``deltaserve.*`` logger (the engine applies ``logging.level``)."""
    logging.getLogger(ROOT_LOGGER).setLevel(level.upper())


class _Formatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")


def configure_logging(level: str = "info", *, stream: Any = None) -> None:
    """For tools and applications that want it: ``deltaserve.*`` records at ``level`` and
    above go to one handler on ``stream`` (default stderr). Idempotent."""
    logger = logging.getLogger(ROOT_LOGGER)
    logger.setLevel(level.upper())
    for h in list(logger.handlers):
        if getattr(h, "_deltaserve", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(_Formatter())
    handler._deltaserve = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.propagate = False
