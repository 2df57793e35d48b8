"""The drafter interface and its registry, keyed by ``speculative.method``.

A drafter proposes up to ``k`` tokens to follow a decoding request's tokens. It is asked once
per step for every running request that may draft (``engine/core/spec_step.py`` decides which:
decoding requests with room for a window, and none while an async step is in flight), on the
engine's thread, before the step is scheduled, so
a proposal must be cheap (host work that every step pays). It may propose fewer tokens, or
none (the request then decodes one token as without speculation). Proposals are only ever
checked, never trusted: a wrong draft costs a rejected position, never a wrong output.

``finished(request, num_output)`` hears of every request that ends with its output (its first
``num_output`` output tokens are what was delivered), for drafters that learn from finished
outputs (``replay``).

Third-party drafters: ``register_drafter(method, factory)`` with a ``SpecMethod``; the factory
takes the ``SpeculativeConfig`` and the vocabulary size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from deltaserve.engine.config_spec import SpecMethod, SpeculativeConfig
from deltaserve.engine.errors import ConfigError
from deltaserve.scheduler.request import Request


class Drafter(Protocol):
    """Proposes draft tokens (see the module docstring)."""

    def propose(self, request: Request, k: int) -> list[int]:
        """At most ``k`` tokens to follow ``request.token_ids`` (a decoding request: its last
        token is sampled, not yet computed)."""
        ...

    def finished(self, request: Request, num_output: int) -> None:
        """``request`` ended; its first ``num_output`` output tokens were delivered."""
        ...


DrafterFactory = Callable[[SpeculativeConfig, int], Drafter]

_DRAFTERS: dict[SpecMethod, DrafterFactory] = {}


def register_drafter(method: SpecMethod, factory: DrafterFactory) -> None:
    """Make ``speculative.method = method`` build its drafter with ``factory(config, vocab_size)``."""
    _DRAFTERS[method] = factory


def make_drafter(config: SpeculativeConfig, vocab_size: int) -> Drafter:
    """The drafter of ``config.method`` (a ``ConfigError`` for a method nothing registered)."""
    # (the built-in drafters register themselves on import)
    from deltaserve.engine.spec import mtp, ngram, replay  # noqa: F401

    factory = _DRAFTERS.get(config.method)
    if factory is None:
        raise ConfigError(f"speculative.method = {config.method.value!r}: no drafter is registered for it")
    return factory(config, vocab_size)
