"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

``translate_error`` maps whatever a handler raised to the ``APIError`` the client sees: 400 for
a bad request (a malformed body, a wrong type, an out-of-range value: the engine's
``InvalidRequestError`` / ``PromptTooLongError``, naming the request field in ``param``), 429
when the engine's waiting queue is full, 503 when the engine is dead or shutting down. Anything
unexpected is a 500 whose message names the exception, never a traceback.
"""

from __future__ import annotations

import re

import msgspec

from deltaserve.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
)
from deltaserve.server import protocol as p

encode = msgspec.json.Encoder().encode


class APIError(Exception):
    """An error response: HTTP ``status`` and the body's fields."""

    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> bytes:
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return encode(p.ErrorResponse(error=info))


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def engine_failure(error: str | None) -> APIError:
    """The error of a completion the engine ended with ``finish_reason="error"``."""
    msg = error or "the request failed in the engine"
    if "shut down" in msg:
        return APIError(503, msg, "service_unavailable_error", None, "engine_shutdown")
    if "engine loop died" in msg:
        return APIError(503, msg, "service_unavailable_error", None, "engine_dead")
    return APIError(500, msg, "internal_error", None, "engine_error")


_SP_FIELD = re.compile(r"^SamplingParams\.(\w+)=")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_JSON_PATH = re.compile(r"at `\$\.?([^`]*)`")
# engine messages that start with a request field's name (lower-cased), and that field
_PREFIXES = (
    ("stop token id", "stop_token_ids"),
    ("cache_salt", "cache_salt"),
    ("request_id", "request_id"),
    ("priority", "priority"),
    ("chat_template_kwargs", "chat_template_kwargs"),
    ("tools", "tools"),
)


def _param_of(message: str, renames: dict[str, str]) -> str | None:
    """The request field an engine error message is about (``renames``: engine name -> API name)."""
    m = _SP_FIELD.match(message)
    if m:
        return renames.get(m.group(1), m.group(1))
    low = message.lower()
    for prefix, param in _PREFIXES:
        if low.startswith(prefix):
            return param
    return renames.get("prompt", "prompt")


def _validation_error(exc: msgspec.ValidationError, renames: dict[str, str]) -> APIError:
    inner = exc.__cause__ or exc.__context__
    if isinstance(inner, InvalidRequestError):  # raised in a struct's __post_init__ (SamplingParams)
        return translate_error(inner, renames)
    msg = str(exc)
    m = _JSON_PATH.search(msg)
    param = re.sub(r"\[\d+\]", "", m.group(1)).split(".")[0] if m and m.group(1) else None
    missing = _MISSING.search(msg)
    if missing and param is None:
        param = missing.group(1)
    return bad_request(msg, param)


def translate_error(exc: BaseException, renames: dict[str, str] | None = None) -> APIError:
    """Map an exception raised while handling a request to the API error the client sees."""
    renames = renames or {}
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(
            400, str(exc), "invalid_request_error", renames.get("prompt", "prompt"), "prompt_too_long"
        )
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), _param_of(str(exc), renames))
    if isinstance(exc, msgspec.ValidationError):
        return _validation_error(exc, renames)
    if isinstance(exc, msgspec.DecodeError):
        return bad_request(f"request body is not valid JSON: {exc}", None, "invalid_json")
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, str(exc), "rate_limit_error", None, "engine_overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable_error", None, "engine_dead")
    return APIError(
        500, f"internal error: {type(exc).__name__}: {exc}", "internal_error", None, "internal_error"
    )
