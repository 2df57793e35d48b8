"""The scheduler's guard on its policy: every call into it is checked.

Policy faults stay local. The policy may be a user's ``module:Class``, so every call into
it (``order_waiting``, ``preemption_victim``, ``stats``) is checked: a call that raises,
an ordering with an object that is not a waiting request or with a request twice, a victim
that was not among the candidates, or malformed stats, is a *policy error*. Each is counted
(``scheduler.policy_errors``), logged once per (call, kind of fault) on the
``deltaserve.scheduler`` logger, and that one call is answered by FCFS (arrival order;
the latest arrival is the victim). An ordering that leaves waiting requests out is also a
policy error but keeps what it did order: the omitted requests follow in FCFS order, so a
policy can never starve the queue (returning ``[]`` forever admits in FCFS order).

The fallback is per call, not a permanent switch: a policy that fails on one odd input
(one request's field, one queue shape) keeps its guarantees (priorities, aging, cache
affinity) on every other step, while a policy that always fails costs one exception per
step, which is small beside a model step, and one log line in all. The counter tells an
operator which case they are in.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from deltaserve.logs import get_logger
from deltaserve.scheduler.policy import FCFSPolicy, PolicyContext, SchedulingPolicy
from deltaserve.scheduler.request import Request

log = get_logger("deltaserve.scheduler")

_FALLBACK = FCFSPolicy()  # answers a policy call that failed


class PolicyGuard:
    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self.errors = 0  # policy errors, each answered by FCFS
        self._logged: set[tuple[str, str]] = set()  # (call, kind) already logged

    def _fault(self, call: str, kind: str, fallback: str = "fcfs for this call", **details: Any) -> None:
        """Count a policy error; log the first of each (call, kind)."""
        self.errors += 1
        if (call, kind) in self._logged:
            return
        self._logged.add((call, kind))
        log.error(
            "scheduler.policy_error",
            policy=type(self.policy).__module__ + ":" + type(self.policy).__qualname__,
            call=call,
            fault=kind,
            fallback=fallback,
            **details,
        )

    def order_waiting(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        """The policy's admission order, checked (module docstring)."""
        try:
            # a copy: a policy that sorts or pops its argument cannot corrupt the queue
            result = self.policy.order_waiting(list(waiting), ctx)
        except Exception as exc:
            self._fault("order_waiting", "raised", error=_describe(exc))
            return _FALLBACK.order_waiting(waiting, ctx)
        try:
            # more items than waiting requests means a duplicate or a stranger; the bound also
            # keeps an endless iterator from hanging the loop
            order = list(itertools.islice(result, len(waiting) + 1))
        except Exception as exc:  # not iterable, or a generator that raised
            self._fault("order_waiting", "bad_result", result=_describe(result), error=_describe(exc))
            return _FALLBACK.order_waiting(waiting, ctx)
        known = {id(r) for r in waiting}
        seen: set[int] = set()
        for r in order:
            if id(r) not in known:
                self._fault("order_waiting", "unknown_item", item=_describe(r))
                return _FALLBACK.order_waiting(waiting, ctx)
            if id(r) in seen:
                self._fault("order_waiting", "duplicate", request_id=r.request_id)
                return _FALLBACK.order_waiting(waiting, ctx)
            seen.add(id(r))
        if len(order) < len(waiting):
            self._fault(
                "order_waiting",
                "omitted",
                "omitted requests follow in fcfs order",
                omitted=len(waiting) - len(order),
            )
            order += [r for r in _FALLBACK.order_waiting(waiting, ctx) if id(r) not in seen]
        return order

    def preemption_victim(self, candidates: Sequence[Request], ctx: PolicyContext) -> Request:
        """The policy's victim among ``candidates``, checked (module docstring)."""
        try:
            victim = self.policy.preemption_victim(list(candidates), ctx)
        except Exception as exc:
            self._fault("preemption_victim", "raised", error=_describe(exc))
            return _FALLBACK.preemption_victim(candidates, ctx)
        if not any(victim is c for c in candidates):
            self._fault("preemption_victim", "not_a_candidate", victim=_describe(victim))
            return _FALLBACK.preemption_victim(candidates, ctx)
        return victim

    def stats(self) -> dict[str, float]:
        try:
            items = list(self.policy.stats().items())
        except Exception as exc:
            self._fault("stats", "raised", "no policy stats", error=_describe(exc))
            return {}
        out: dict[str, float] = {}
        for k, v in items:
            if isinstance(k, str) and isinstance(v, (int, float)):
                out[k] = v
            else:
                self._fault("stats", "bad_entry", "entry dropped", entry=_describe((k, v)))
        return out


def _describe(value: object, limit: int = 200) -> str:
    """A short, never-raising description of what a policy gave back or raised."""
    if isinstance(value, Request):
        return f"Request({value.request_id!r})"
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__} with a failing repr>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
