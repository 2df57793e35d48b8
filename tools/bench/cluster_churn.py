"""Replica churn for ``bench_cluster.py --churn FRACTION``: one replica killed mid-run, its
replacement started by Ray Serve while the workload goes on; the report splits at the kill.

* **Schedule** (``churn_threshold``): the kill fires when ``FRACTION`` of the workload's
  expected requests have finished (ok or failed; warm-up requests do not count), at least one
  and at most all but one, so there is always a "before" and an "after".
* **Trigger** (``ChurnBackend``): wraps the loadgen backend; every workload request that ends
  counts, and the request that reaches the threshold starts the churn (once) as a background
  task, so requests keep flowing while a replica dies and its replacement starts. The rids that
  had finished by then are the "before" set; every other request is "after" (those in flight
  at the kill included).
* **Churn** (``kill_and_replace``, needs Ray): kills one engine replica actor of the
  application (``ray.kill(no_restart=True)``, as the cluster fault test does); the deployment's
  ``num_replicas`` is fixed, so Serve's controller starts a fresh replica to replace it. That
  replica joins mid-run with a cold cache (or one the shared tier can fill). Waits until a new
  replica actor is RUNNING and the deployment is back to its replica count, then reports the
  seconds that took.
* **Report** (``ChurnReport`` / ``churn_rows``): per column, the request-level hit rate and
  the failed requests before and after the kill, the ingress's retry / replica-failure counters
  (``/cluster/status``) and the replacement's start time; ``-`` in columns without churn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltaserve.logs import get_logger

log = get_logger("deltaserve.cluster")

#: loadgen's warm-up requests are named so (``tools/live.py``): not part of the schedule
WARMUP_PREFIX = "warmup-"


def churn_fraction(text: str) -> float:
    """``--churn``'s value: a share of the requests strictly between 0 and 1."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--churn = {text!r}: a number between 0 and 1") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"--churn = {text!r}: must be > 0 and < 1")
    return value


def churn_threshold(total_requests: int, fraction: float) -> int:
    """Finished requests at which the kill fires: ``round(fraction * total)`` kept within
    ``[1, total - 1]`` (a "before" and an "after" always exist; needs ``total >= 2``)."""
    if total_requests < 2:
        raise ValueError(f"churn needs at least 2 requests, the workload has {total_requests}")
    return min(max(round(fraction * total_requests), 1), total_requests - 1)


@dataclass
class ChurnResult:
    """What the churn task did: the replica killed, and how long its replacement took."""

    killed: str | None = None
    replacement: str | None = None
    replaced_after_s: float | None = None  # None: no replacement RUNNING before the deadline
    error: str | None = None


class ChurnBackend:
    """A loadgen backend that starts ``churn()`` once ``threshold`` workload requests ended
    (module docstring). Everything but ``stream`` is the wrapped backend's."""

    def __init__(self, inner: Any, threshold: int, churn: Callable[[], Awaitable[ChurnResult]]) -> None:
        self.inner = inner
        self.threshold = threshold
        self._churn = churn
        self.finished: list[str] = []  # workload rids in the order they ended
        self.before: frozenset[str] | None = None  # the rids ended when the kill fired
        self.task: asyncio.Task[ChurnResult] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def stream(self, spec: Any) -> AsyncIterator[Any]:
        try:
            async for d in self.inner.stream(spec):
                yield d
        finally:
            if not spec.rid.startswith(WARMUP_PREFIX):
                self._ended(spec.rid)

    def _ended(self, rid: str) -> None:
        self.finished.append(rid)
        if self.task is None and len(self.finished) >= self.threshold:
            self.before = frozenset(self.finished)
            self.task = asyncio.ensure_future(self._churn())

    async def result(self, timeout_s: float) -> ChurnResult | None:
        """The churn's result (waiting up to ``timeout_s`` for the replacement); None when it
        never fired."""
        if self.task is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except TimeoutError:
            return ChurnResult(error=f"replacement not running {timeout_s:.0f}s after the run")


@dataclass
class Phase:
    """Requests on one side of the kill."""

    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0  # of the ok requests
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass
class ChurnReport:
    """One column's churn numbers."""

    done_at_kill: int
    total: int
    before: Phase = field(default_factory=Phase)
    after: Phase = field(default_factory=Phase)
    ingress: dict[str, int] = field(default_factory=dict)
    result: ChurnResult | None = None

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def churn_report(
    records: Iterable[Any], before: frozenset[str], ingress: Mapping[str, Any], result: ChurnResult | None
) -> ChurnReport:
    """Split a column's ``RequestRecord``s at the kill (``before``: rids ended by then)."""
    records = list(records)
    rep = ChurnReport(
        done_at_kill=len(before),
        total=len(records),
        ingress={k: int(v) for k, v in ingress.items() if isinstance(v, (int, float))},
        result=result,
    )
    for r in records:
        phase = rep.before if r.rid in before else rep.after
        phase.requests += 1
        if not r.ok:
            phase.failed += 1
            continue
        phase.prompt_tokens += r.num_prompt_tokens
        phase.cached_tokens += r.num_cached_tokens
    return rep


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def churn_rows(reports: Sequence[ChurnReport | None]) -> list[tuple[str, list[str]]]:
    """``format_table`` extra rows, one value per column (``-`` where a column had no churn);
    none at all when no column churned."""
    if not any(reports):
        return []

    def row(fn: Callable[[ChurnReport], str]) -> list[str]:
        return [fn(r) if r is not None else "-" for r in reports]

    def replaced(r: ChurnReport) -> str:
        res = r.result
        if res is None or res.replaced_after_s is None:
            return "no" if res is None or res.error is None else f"no ({res.error})"
        return f"{res.replaced_after_s:.1f}"

    return [
        ("churn: requests ended at kill", row(lambda r: f"{r.done_at_kill}/{r.total}")),
        (
            "hit rate before / after kill %",
            row(lambda r: f"{_pct(r.before.hit_rate)} / {_pct(r.after.hit_rate)}"),
        ),
        ("failed before / after kill", row(lambda r: f"{r.before.failed} / {r.after.failed}")),
        (
            "ingress retries / replica failures",
            row(lambda r: f"{r.ingress.get('retries', 0)} / {r.ingress.get('replica_failures', 0)}"),
        ),
        ("replacement running after (s)", row(replaced)),
    ]


# ---------------------------------------------------------------------------- Ray
def _replica_actors(app_name: str, deployment: str) -> list[str]:
    """Names of the live actors of ``app_name``'s ``deployment`` replicas (Serve names them
    ``SERVE_REPLICA::APP#DEPLOYMENT#ID``)."""
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{app_name}#{deployment}#" in a["name"]
    )


def _replica_states(app_name: str, deployment: str) -> dict[str, int]:
    """Serve's replica counts by state (``RUNNING``, ``STARTING``, ...) for the deployment."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or deployment not in app.deployments:
        return {}
    states = app.deployments[deployment].replica_states.items()
    return {str(getattr(k, "value", k)): int(v) for k, v in states if int(v)}


def kill_and_replace(
    app_name: str, replicas: int, deployment: str = "EngineReplica", timeout_s: float = 300.0
) -> ChurnResult:
    """Kill one replica actor of the app; wait for Serve's replacement (module docstring).
    Blocking: run it in a thread."""
    import ray

    res = ChurnResult()
    names = _replica_actors(app_name, deployment)
    if not names:
        res.error = f"no replica actor of {app_name}#{deployment}"
        return res
    victim = names[0]
    namespace = next(
        a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == victim
    )
    t0 = time.monotonic()
    ray.kill(ray.get_actor(victim, namespace=namespace), no_restart=True)
    res.killed = victim.rsplit("#", 1)[-1]
    log.warning("bench.churn_killed", app=app_name, replica=res.killed)
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        new = [n for n in _replica_actors(app_name, deployment) if n not in names]
        states = _replica_states(app_name, deployment)
        # Serve may count the killed replica RUNNING until its health check fails: done only
        # when a new actor exists and N replicas are RUNNING with none starting or stopping
        busy = sum(v for k, v in states.items() if k not in ("RUNNING", "STOPPED"))
        if new and states.get("RUNNING", 0) == replicas and not busy:
            res.replacement = new[0].rsplit("#", 1)[-1]
            res.replaced_after_s = time.monotonic() - t0
            log.warning(
                "bench.churn_replaced", app=app_name, replica=res.replacement, seconds=res.replaced_after_s
            )
            return res
        time.sleep(0.25)
    res.error = f"no replacement RUNNING after {timeout_s:.0f}s"
    return res
