"""Walking a workload without a model: deterministic synthetic replies, and every request with
its reply in breadth-first order (the simulator and the tests)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from deltaserve.tools.workloads.request import RequestSpec
from deltaserve.tools.workloads.text import WORDS
from deltaserve.tools.workloads.workload import Workload


def synthetic_reply(workload: Workload, spec: RequestSpec) -> list[int]:
    """Deterministic reply of exactly ``spec.max_tokens`` tokens (English-like words)."""
    rng = workload.rng("reply", spec.rid)
    ids: list[int] = []
    while len(ids) < spec.max_tokens:
        ids += workload.text.piece_ids(" " + rng.choice(WORDS))
    return ids[: spec.max_tokens]


def expand(
    workload: Workload, reply: Callable[[Workload, RequestSpec], list[int]] = synthetic_reply
) -> list[tuple[RequestSpec, list[int]]]:
    """Every request of the workload with its reply, breadth first (no timing)."""
    queue = deque(workload.roots())
    out: list[tuple[RequestSpec, list[int]]] = []
    while queue:
        spec = queue.popleft()
        ids = reply(workload, spec)
        out.append((spec, ids))
        queue.extend(workload.follow_ups(spec, ids))
    return out
