"""The messages between a front end (``AsyncEngine``) and an engine core, in every placement.

``TokenDelta`` is what an ``EngineCore`` step emits (token ids, never text) and ``Ready`` what a
core tells a front end when it starts; the front end's output processor turns deltas into
``RequestOutput``s (``engine/front/output_processor.py``). Between processes (the core process,
``engine/core/core_proc.py``) they are msgspec structs, msgpack-encoded, one ZeroMQ frame each. A front end
sends ``Hello`` first (its pid: the core aborts its requests if it dies), then ``AddRequest`` /
``AbortRequests`` / ``GetStats`` / ``CompileConstraint`` / ``CheckIntegrity``, and ``Shutdown``
when it owns the core. The core answers ``Hello`` with ``Ready`` (or ``StartFailed``),
``CompileConstraint`` with ``ConstraintCompiled`` once its grammar workers are done,
``CheckIntegrity`` with ``IntegrityChecked`` (checked between two steps), and sends one
``StepOutputs`` per step and front end: token ids only, never text (the front end detokenizes
and applies stop strings), plus the engine's stats every ``STATS_INTERVAL_S`` and whenever it
goes idle.

What a front end sends it has validated: the core decodes it under ``trusted_decode()``
(``SamplingParams`` and ``Constraint`` are not checked again).

Request ids on this wire are the core's: a front end maps them to its streams, so front ends
never collide on a user's ``request_id``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from deltaserve.engine.constraint import Constraint
from deltaserve.engine.front.client import ModelInfo
from deltaserve.engine.outputs import TokenLogprob
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.scheduler.request import Request

#: how often the core sends its stats while it works (and once each time it goes idle)
STATS_INTERVAL_S = 0.25


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """A front end connects: its pid (the core watches it) and whether it owns the core."""

    pid: int
    owner: bool = False


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """One engine request, validated and tokenized by the front end (``n == 1``: a front end
    sends each of an ``n > 1`` request's completions as a request of its own)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: bytes = b""
    arrival_time: float = 0.0  # time.monotonic() in the front end (one clock per machine)


def request_of(add: AddRequest) -> Request:
    """The scheduler ``Request`` of a front end's ``AddRequest`` (validated there: not again)."""
    # (Request's first six fields, in order)
    arrival = add.arrival_time or time.monotonic()
    return Request(
        add.request_id, add.prompt_token_ids, add.sampling_params, add.priority, add.cache_salt, arrival
    )


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Abort these requests (a stop string ended them, the client left, ``abort()``)."""

    request_ids: list[str]


class GetStats(msgspec.Struct, tag="get_stats", array_like=True):
    """Send this front end the engine's stats now (a ``StepOutputs`` without deltas)."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """The owning front end is done: abort what is left, close the engine, exit 0."""


class CompileConstraint(msgspec.Struct, tag="compile", array_like=True):
    """Compile this constraint on the core's grammar workers and answer ``ConstraintCompiled``
    with the same ``token`` (the front end waits at most its deadline, then gives up)."""

    token: int
    constraint: Constraint


class CheckIntegrity(msgspec.Struct, tag="check", array_like=True):
    """Run ``EngineCore.check_integrity()`` (cache and scheduler accounting) between two steps
    and answer ``IntegrityChecked`` with the same ``token`` (a diagnostics and testing aid)."""

    token: int


FrontMessage = Hello | AddRequest | AbortRequests | GetStats | Shutdown | CompileConstraint | CheckIntegrity


class TokenDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's new token ids of one step (``RequestOutput`` without text): what
    ``EngineCore.step`` emits; ``finish_reason`` set on its last (a stop token, EOS, the grammar's
    end, ``max_tokens`` / ``max_model_len``, an abort or an error: stop strings are the front end's)."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    queue_time_s: float | None = None
    prefill_time_s: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None
    # speculative decoding: the request's drafted and accepted draft tokens so far, on each
    # delta that carries a verify's tokens and on its final one (0: none yet, or off)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        """The request's last delta."""
        return self.finish_reason is not None


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """The deltas of one step for one front end; ``stats`` when due (else None)."""

    deltas: list[TokenDelta]
    stats: dict[str, Any] | None = None


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The core is serving: what a front end needs to build its ``InputProcessor`` (the model,
    the salt parts the cache hashes with, the longest token's characters, the model's request
    defaults and where they come from, the configured chat template's text or None), the core's
    pid and its stats."""

    model_info: ModelInfo
    salt_parts: list[str]
    max_token_chars: int
    pid: int
    stats: dict[str, Any]
    sampling_defaults: dict[str, Any] = {}
    sampling_source: str = ""
    chat_template: str | None = None


class StartFailed(msgspec.Struct, tag="start_failed", array_like=True):
    """Building the engine raised: the error's type name and message."""

    kind: str
    message: str


class ConstraintCompiled(msgspec.Struct, tag="compiled", array_like=True):
    """The constraint of ``CompileConstraint`` ``token`` is compiled (``error`` None) or did not
    compile (why)."""

    token: int
    error: str | None = None


class IntegrityChecked(msgspec.Struct, tag="checked", array_like=True):
    """The answer to ``CheckIntegrity`` ``token``: ``error`` None when the accounting holds, else
    the ``AssertionError``'s message."""

    token: int
    error: str | None = None


CoreMessage = StepOutputs | Ready | StartFailed | ConstraintCompiled | IntegrityChecked
