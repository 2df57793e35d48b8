"""Typed errors of the public API. Each message names the offending value.

::

    DeltaServeError                  every error deltaserve raises
    ├── ConfigError (ValueError)     a config key has an invalid value; at load / construction
    ├── InvalidRequestError (ValueError)   generate() rejected one request
    │   ├── PromptTooLongError       ... because it cannot fit max_model_len
    │   └── GrammarTimeoutError      ... because its output constraint did not compile in time
    ├── EngineOverloadedError        generate() found the waiting queue full: retry later
    └── EngineDeadError              the engine is not running: no request can be served

Request errors are raised by ``generate`` itself, before the request is queued, and
affect no other request. Failures *during* generation (a failed model step) are not
raised: the request's stream ends with ``finish_reason="error"`` and ``error`` set.
All are importable from ``deltaserve``.
"""

from __future__ import annotations


class DeltaServeError(Exception):
    """Base class of every error raised by deltaserve: ``except DeltaServeError`` catches them all."""


class ConfigError(DeltaServeError, ValueError):
    """A configuration value is invalid: an unknown key, a wrong type, a value out of range,
    an unreadable file, or sizes that cannot work together (e.g. a cache budget too small
    for one KV block, ``model.max_model_len`` beyond the KV pool, a CUDA device that is not
    there). Raised by ``EngineConfig.load`` / ``from_dict`` / the section constructors, and
    at engine start for what needs the model or the device; the message names the dotted
    key and the value (``cache.block_size = 0: Expected `int` >= 1``). Every key:
    docs/config.md."""


class InvalidRequestError(DeltaServeError, ValueError):
    """``generate`` rejected a request before queueing it; no other request is affected.

    For example: an empty prompt, a token id outside the vocabulary, chat messages the
    chat template cannot render, ``sampling_params`` that are not ``SamplingParams`` (whose
    own out-of-range values raise this at construction), a ``request_id`` already in use,
    a stop token id outside the vocabulary.
    """


class PromptTooLongError(InvalidRequestError):
    """The prompt can never run: it has ``max_model_len`` tokens or more (room for at least
    one generated token is needed). ``max_model_len`` is ``model.max_model_len``, or by
    default what the model and the KV pool allow; the ``engine.ready`` log line shows it."""


class GrammarTimeoutError(InvalidRequestError):
    """The request's output constraint did not compile within
    ``structured_outputs.compile_timeout_s`` (an HTTP server answers 400). The compile goes on in
    the background and its result is cached: the same constraint sent again once it is done
    is served at once. A smaller schema (fewer optional properties, shorter enums) compiles
    faster."""


class EngineOverloadedError(DeltaServeError):
    """The waiting queue is full (``scheduler.max_waiting`` requests wait): the request was
    not queued. Retry later (an HTTP server answers 503/429), or raise ``max_waiting``."""


class EngineDeadError(DeltaServeError):
    """The engine cannot serve requests: it was not started (use ``async with
    AsyncEngine(config) as engine``), it has shut down, or its loop died (the message says
    why; every open stream ended with ``finish_reason="error"``). Start a new engine."""
