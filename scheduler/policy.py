"""Scheduling policies: how the waiting queue is ordered and who is preempted first.

A policy is a small class (``SchedulingPolicy``) registered by name; the config names one
(``scheduler.policy = "lpm"``) or gives ``"package.module:ClassName"`` for a user's own.
Options come from ``[scheduler.policy_options]`` as keyword arguments. Policies are
torch-free and see requests only through ``Request`` and a ``PolicyContext``.

Built-ins:

============  =========================================================================
``fcfs``      arrival order; the latest arrival is preempted first
``priority``  lower ``priority`` value first, FCFS within a level; a waiting request's
              effective priority improves by one level every ``aging_steps`` steps so low
              priorities are never starved; the worst effective priority is preempted
``lpm``       longest cached prefix first (cache lookups), aged by ``aging_tokens_per_step``
              of virtual prefix per waiting step; falls back to FCFS when more than
              ``max_queue`` requests wait, so scheduling stays cheap
``sjf``       shortest uncomputed prompt first, aged like ``priority``
============  =========================================================================
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from deltaserve.scheduler.request import Request


@dataclass
class PolicyContext:
    step: int  # scheduler step counter
    now: float  # time.monotonic()
    cached_prefix: Callable[[Request], int]  # joint-hit tokens for a waiting request


class SchedulingPolicy(ABC):
    """Orders the waiting queue and chooses preemption victims.

    ``order_waiting`` returns the waiting requests in the order admission is tried (the
    scheduler stops at the first that does not fit, so the order is also a promise of
    fairness): a permutation of ``waiting``. ``preemption_victim`` picks one of
    ``candidates`` (running requests not yet scheduled in this step) to free and requeue;
    when there is no candidate the request that needs memory is preempted without asking.

    The scheduler does not trust a policy (it may be a user's ``module:Class``): a call
    that raises or breaks this contract is counted (``scheduler.policy_errors``), logged
    once per kind of fault, and answered by FCFS for that call; an ordering that leaves
    waiting requests out is completed with them in FCFS order. See ``Scheduler``.
    """

    name: str = ""

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"policy {self.name!r} takes no options, got {sorted(options)}")

    @abstractmethod
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]: ...

    def preemption_victim(self, candidates: Sequence[Request], ctx: PolicyContext) -> Request:
        # Default: the most recent arrival loses the least work and was promised the least.
        return max(candidates, key=lambda r: (r.arrival_time, r.arrival_step))

    def stats(self) -> dict[str, float]:
        return {}


def _fcfs_key(r: Request) -> tuple[float, int]:
    return (r.arrival_time, r.arrival_step)


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        # Preempted requests keep their original arrival time, so they go back in front.
        return sorted(waiting, key=_fcfs_key)


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def __init__(self, aging_steps: int = 64) -> None:
        if not isinstance(aging_steps, int) or aging_steps < 1:
            raise ValueError(f"priority: aging_steps must be an integer >= 1, got {aging_steps!r}")
        self.aging_steps = aging_steps

    def effective(self, r: Request, ctx: PolicyContext) -> Fraction:
        """``priority - steps_waited / aging_steps``, exact (lower is served first)."""
        return Fraction(self._scaled(r, ctx), self.aging_steps)

    def _scaled(self, r: Request, ctx: PolicyContext) -> int:
        # ``effective * aging_steps``: the same order, in integer arithmetic, so any int
        # priority is safe (a float of 10**400 overflows) and no precision is lost on large ones.
        return r.priority * self.aging_steps - (ctx.step - r.arrival_step)

    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        return sorted(waiting, key=lambda r: (self._scaled(r, ctx), *_fcfs_key(r)))

    def preemption_victim(self, candidates: Sequence[Request], ctx: PolicyContext) -> Request:
        return max(candidates, key=lambda r: (r.priority, *_fcfs_key(r)))


class LPMPolicy(SchedulingPolicy):
    name = "lpm"

    def __init__(self, max_queue: int = 128, aging_tokens_per_step: float = 8.0) -> None:
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"lpm: max_queue must be an integer >= 1, got {max_queue!r}")
        if not isinstance(aging_tokens_per_step, (int, float)) or aging_tokens_per_step < 0:
            raise ValueError(f"lpm: aging_tokens_per_step must be >= 0, got {aging_tokens_per_step!r}")
        self.max_queue = max_queue
        self.aging = float(aging_tokens_per_step)
        self.fallbacks = 0

    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        if len(waiting) > self.max_queue:
            self.fallbacks += 1
            return sorted(waiting, key=_fcfs_key)
        # A waiting request earns `aging` tokens of virtual cached prefix per step, so a
        # request with no hit is not overtaken forever by a stream of cache hits.
        score = {id(r): ctx.cached_prefix(r) + self.aging * (ctx.step - r.arrival_step) for r in waiting}
        return sorted(waiting, key=lambda r: (-score[id(r)], *_fcfs_key(r)))

    def stats(self) -> dict[str, float]:
        return {"lpm_fcfs_fallbacks": self.fallbacks}


class SJFPolicy(SchedulingPolicy):
    name = "sjf"

    def __init__(self, aging_tokens_per_step: float = 16.0) -> None:
        if not isinstance(aging_tokens_per_step, (int, float)) or aging_tokens_per_step < 0:
            raise ValueError(f"sjf: aging_tokens_per_step must be >= 0, got {aging_tokens_per_step!r}")
        self.aging = float(aging_tokens_per_step)

    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        def key(r: Request) -> tuple[float, float, int]:
            age = ctx.step - r.arrival_step
            return (r.num_uncomputed_tokens - self.aging * age, *_fcfs_key(r))

        return sorted(waiting, key=key)

    def preemption_victim(self, candidates: Sequence[Request], ctx: PolicyContext) -> Request:
        # The request with the most work left loses the least progress relative to its size.
        return max(candidates, key=lambda r: (r.num_uncomputed_tokens, *_fcfs_key(r)))


POLICIES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (FCFSPolicy, PriorityPolicy, LPMPolicy, SJFPolicy)
}


def register_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    """Class decorator adding a policy to the registry under ``cls.name``."""
    if not cls.name:
        raise ValueError("a registered policy needs a non-empty name")
    POLICIES[cls.name] = cls
    return cls


def resolve_policy_class(name: str) -> type[SchedulingPolicy]:
    if ":" in name:
        module_name, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module_name), attr)
        if not (isinstance(cls, type) and issubclass(cls, SchedulingPolicy)):
            raise TypeError(f"{name} is not a SchedulingPolicy subclass")
        return cls
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy; known: {', '.join(sorted(POLICIES))}, or package.module:ClassName"
        ) from None


def make_policy(name: str, options: dict[str, Any] | None = None) -> SchedulingPolicy:
    return resolve_policy_class(name)(**(options or {}))
