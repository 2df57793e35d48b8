"""Send a workload through one backend, live: ``run_live`` drives sessions (a closed loop of N
in flight, or roots at planned times), sends each follow-up ``delay_s`` after the reply it
depends on, and records one ``RequestRecord`` per request (TTFT and token times from arrival),
plus the backend's counters over the run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deltaserve.logs import get_logger
from deltaserve.tools.backends import Delta
from deltaserve.tools.metrics import RequestRecord, stats_delta, summarize
from deltaserve.tools.workloads import RequestSpec, Workload

log = get_logger("deltaserve.loadgen")


@dataclass
class RunResult:
    label: str
    backend: dict[str, Any]
    records: list[RequestRecord]
    summary: dict[str, Any]
    engine_stats: dict[str, Any]
    engine_stats_total: dict[str, Any]
    arrivals: dict[str, Any]
    wall_s: float


async def _warmup(backend: Any, n: int, prompt_len: int) -> None:
    """``n`` concurrent requests of the workload's prompt length, not measured. Each has
    its own cache salt, so nothing it caches can ever be hit by the workload."""

    async def one(i: int) -> None:
        spec = RequestSpec(
            rid=f"warmup-{i}",
            prompt_ids=[0] * prompt_len,
            max_tokens=8,
            meta={"cache_salt": f"loadgen-warmup-{i}"},
        )
        async for _ in backend.stream(spec):
            pass

    await asyncio.gather(*(one(i) for i in range(n)))


class LiveRun:
    """The requests of one column in flight: the clock (seconds since the first send), the
    records in completion order, and the progress bar (running hit rate as its postfix)."""

    def __init__(self, backend: Any, workload: Workload, bar: Any) -> None:
        self.backend = backend
        self.workload = workload
        self.bar = bar
        self.records: list[RequestRecord] = []
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(self, roots: Sequence[RequestSpec], arrival_plan: dict[str, Any]) -> None:
        """Every session to its end: roots as ``arrival_plan`` says, follow-ups after their delays."""
        if arrival_plan["mode"] == "closed":
            sem = asyncio.Semaphore(int(arrival_plan["concurrency"]))

            async def session(root: RequestSpec) -> None:
                async with sem:
                    await self.run_tree(root, self.now())

            await asyncio.gather(*(session(r) for r in roots))
            return

        async def timed(root: RequestSpec, at: float) -> None:
            delay = at - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.run_tree(root, at)

        await asyncio.gather(*(timed(r, t) for r, t in zip(roots, arrival_plan["times"], strict=True)))

    async def run_tree(self, spec: RequestSpec, due: float) -> None:
        """``spec``, then (when it succeeded) its follow-ups, each after its own delay."""
        rec = await self.run_one(spec, due)
        if not rec.ok:
            return
        children = self.workload.follow_ups(spec, rec.output_token_ids)
        await asyncio.gather(*(self._after_delay(c) for c in children))

    async def _after_delay(self, child: RequestSpec) -> None:
        if child.delay_s > 0:
            await asyncio.sleep(child.delay_s)
        await self.run_tree(child, self.now())

    async def run_one(self, spec: RequestSpec, due: float) -> RequestRecord:
        rec = RequestRecord(
            rid=spec.rid, session=spec.session, turn=spec.turn, branch=spec.branch, arrival_s=due,
            submit_s=self.now(), num_prompt_tokens=len(spec.prompt_ids), max_tokens=spec.max_tokens,
            prompt_hash=spec.describe()["prompt_hash"],
        )  # fmt: skip
        try:
            async for d in self.backend.stream(spec):
                self._record(rec, d, self.now())
        except Exception as e:  # typed engine errors (too long, overloaded, ...)
            rec.error = f"{type(e).__name__}: {e}"
            rec.finish_reason = "error"
            log.warning("loadgen.request_failed", rid=spec.rid, error=rec.error)
        rec.num_output_tokens = len(rec.output_token_ids)
        self.records.append(rec)
        self._progress()
        return rec

    @staticmethod
    def _record(rec: RequestRecord, d: Delta, t: float) -> None:
        if d.token_ids:
            if rec.first_token_s is None:
                rec.first_token_s = t
            rec.token_times.extend([t] * len(d.token_ids))
            rec.output_token_ids.extend(d.token_ids)
        rec.num_prompt_tokens = d.num_prompt_tokens or rec.num_prompt_tokens
        rec.num_cached_tokens = d.num_cached_tokens
        if d.finished:
            rec.finish_s = t
            rec.finish_reason = d.finish_reason
            rec.error = d.error

    def _progress(self) -> None:
        self.bar.update(1)
        done = [r for r in self.records if r.ok]
        if done:
            hit = sum(r.num_cached_tokens for r in done) / max(sum(r.num_prompt_tokens for r in done), 1)
            self.bar.set_postfix(hit=f"{hit:.0%}", refresh=False)


async def run_live(
    backend: Any,
    workload: Workload,
    arrival_plan: dict[str, Any],
    *,
    label: str,
    progress: bool = True,
    warmup: int = 2,
) -> RunResult:
    """Send the workload through ``backend``; one ``RequestRecord`` per request."""
    from tqdm import tqdm

    await backend.start()
    try:
        roots = workload.roots()
        await _warmup(backend, warmup, min(max((len(r.prompt_ids) for r in roots), default=16), 1024))
        refresh = getattr(backend, "refresh_stats", None)  # a remote server: scrape its counters now
        if refresh is not None:
            await refresh()
        stats_before = backend.stats()
        bar = tqdm(
            total=workload.expected_requests(), desc=label, unit="req", disable=not progress, leave=False
        )
        live = LiveRun(backend, workload, bar)
        await live.send(roots, arrival_plan)
        wall = live.now()
        bar.close()
        if refresh is not None:
            await refresh()
        stats_after = backend.stats()
    finally:
        await backend.stop()
    engine_stats = stats_delta(stats_before, stats_after) if stats_after else {}
    records = sorted(live.records, key=lambda r: (r.submit_s, r.rid))
    summary = summarize(records, engine_stats or None)
    log.info(
        "loadgen.run_done",
        label=label,
        requests=len(records),
        wall_s=round(wall, 2),
        out_tok_s=round(summary["output_throughput"], 1),
        hit_rate=round(summary["prefix_hit_rate"], 3),
    )
    return RunResult(
        label=label,
        backend=backend.describe(),
        records=records,
        summary=summary,
        engine_stats=engine_stats,
        engine_stats_total=dict(stats_after),
        arrivals=dict(arrival_plan),
        wall_s=wall,
    )
