"""Fault injection for an engine core in either placement.

Each ``inject_*`` function patches an ``EngineCore``: a test calls it on an in-process
``AsyncEngine``'s core directly, and a separate core process calls it through the
``DELTASERVE_CORE_HOOK=tests.reliability.core_hooks:<hook>`` diagnostics hook
(``engine/core/core_proc.py``), which hands over the ``CoreServer`` before the core serves. A hook
reads its parameters from ``DELTASERVE_TEST_FAULT_*`` environment variables, which the core
process inherits from the test (``monkeypatch.setenv`` before the client starts).
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from deltaserve.engine import EngineCore, RequestOutput

if TYPE_CHECKING:  # the core process imports this module: no pytest there
    import pytest

HOOK_ENV = "DELTASERVE_CORE_HOOK"
AT_ENV = "DELTASERVE_TEST_FAULT_AT"  # which call (1-based) raises
KIND_ENV = "DELTASERVE_TEST_FAULT_KIND"  # a key of ERRORS


class Doom(BaseException):
    """A BaseException that is neither Exception nor CancelledError."""


ERRORS: dict[str, BaseException] = {
    "cancelled": asyncio.CancelledError(),
    "doom": Doom("custom"),
    "keyerror": KeyError("plain"),
}


def inject_step_fault(core: EngineCore, at: int, error: BaseException) -> None:
    """``core.step()`` raises ``error`` on its ``at``-th call (a fault outside any one request)."""
    real = core.step
    calls = {"n": 0}

    def step() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] == at:
            raise error
        return real()

    core.step = step  # type: ignore[method-assign]


def inject_commit_fault(core: EngineCore, at: int) -> None:
    """The cache's ``commit_step`` raises ``RuntimeError("injected commit fault")`` on its
    ``at``-th call."""
    real = core.cache.commit_step
    calls = {"n": 0}

    def commit(plan: Any) -> None:
        calls["n"] += 1
        if calls["n"] == at:
            raise RuntimeError("injected commit fault")
        real(plan)

    core.cache.commit_step = commit  # type: ignore[method-assign]


def step_fault(loop: Any) -> None:
    """Core hook: ``inject_step_fault`` with ``DELTASERVE_TEST_FAULT_AT`` / ``_KIND``."""
    inject_step_fault(loop.core, int(os.environ[AT_ENV]), ERRORS[os.environ[KIND_ENV]])


def commit_fault(loop: Any) -> None:
    """Core hook: ``inject_commit_fault`` with ``DELTASERVE_TEST_FAULT_AT``."""
    inject_commit_fault(loop.core, int(os.environ[AT_ENV]))


def use_hook(monkeypatch: pytest.MonkeyPatch, hook: str, **params: Any) -> None:
    """Make the next core process this test starts run ``hook`` with ``params``
    (``at`` -> ``DELTASERVE_TEST_FAULT_AT``, ``kind`` -> ``DELTASERVE_TEST_FAULT_KIND``)."""
    monkeypatch.setenv(HOOK_ENV, f"tests.reliability.core_hooks:{hook}")
    for key, value in params.items():
        monkeypatch.setenv({"at": AT_ENV, "kind": KIND_ENV}[key], str(value))


def inject_leaked_block(core: EngineCore) -> None:
    """Take one KV block out of the pool without an owner: the accounting check must see it."""
    core.cache.blocks.allocate()


def leaked_block(loop: Any) -> None:
    """Core hook: ``inject_leaked_block``."""
    inject_leaked_block(loop.core)
