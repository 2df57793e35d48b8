"""Typed errors of the public API. Each message names the offending value."""

from __future__ import annotations


class DeltaServeError(Exception):
    """Base class of every error raised by deltaserve."""


class ConfigError(DeltaServeError, ValueError):
    """A configuration value is invalid (raised at load, naming the key and the value)."""


class InvalidRequestError(DeltaServeError, ValueError):
    """A request was rejected before admission; no other request is affected."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) exceeds max_model_len or the whole KV pool."""


class EngineOverloadedError(DeltaServeError):
    """The waiting queue is full (scheduler.max_waiting); retry later."""


class EngineDeadError(DeltaServeError):
    """The engine loop has stopped; no request can be served."""
