"""How sessions arrive: Poisson (open loop), a closed loop of N in flight, or a trace's own times."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deltaserve.tools.workloads.request import RequestSpec

DEFAULT_CONCURRENCY = 8


@dataclass
class ArrivalParams:
    rate: float | None = None  # Poisson sessions/requests per second (open loop)
    concurrency: int | None = None  # sessions in flight (closed loop)


def plan_arrivals(
    roots: Sequence[RequestSpec], arrival: ArrivalParams, seed: int, *, default_concurrency: int | None = None
) -> dict[str, Any]:
    """How roots arrive: ``{"mode": "poisson"|"trace"|"closed", "times": [...]|None, "concurrency"}``.

    ``--rate`` gives Poisson arrivals of sessions (times drawn from ``seed``); otherwise
    ``--concurrency`` a closed loop; otherwise a trace's own ``arrival_s``; otherwise a
    closed loop of ``default_concurrency`` (the workload's, else ``DEFAULT_CONCURRENCY``)
    sessions."""
    if arrival.rate is not None:
        if arrival.rate <= 0:
            raise ValueError("--rate must be > 0")
        rng = random.Random(f"{seed}:arrivals")
        t, times = 0.0, []
        for _ in roots:
            times.append(t)
            t += rng.expovariate(arrival.rate)
        return {"mode": "poisson", "rate": arrival.rate, "times": times, "concurrency": None}
    if arrival.concurrency is not None:
        if arrival.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        return {"mode": "closed", "rate": None, "times": None, "concurrency": arrival.concurrency}
    if roots and all(r.arrival_s is not None for r in roots):
        return {"mode": "trace", "rate": None, "times": [r.arrival_s for r in roots], "concurrency": None}
    n = default_concurrency or DEFAULT_CONCURRENCY
    return {"mode": "closed", "rate": None, "times": None, "concurrency": n}
