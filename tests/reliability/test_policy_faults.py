"""A policy that breaks its contract never kills the scheduler, torch-free.

Each case runs the real Scheduler + CacheManager to completion, checks integrity after every
step, and asserts: every request finishes, the fault is counted in
``scheduler.policy_errors``, logged once on ``deltaserve.scheduler``, and answered by FCFS.
"""

from __future__ import annotations

import contextlib
import itertools
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

import deltaserve.scheduler.policy_guard as policy_guard_module
from deltaserve.scheduler import FCFSPolicy, PolicyContext, Request, Scheduler, SchedulingPolicy, make_policy
from tests.scheduler.test_policies import make_scheduler


class Params:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens


def req(rid: str, n: int, *, t: float, prio: int = 0, max_tokens: int = 4) -> Request:
    base = 1000 * (zlib.crc32(rid.encode()) % 997)
    r = Request(rid, list(range(base, base + n)), Params(max_tokens), priority=prio)
    r.arrival_time = t
    return r


def run(s: Scheduler, reqs: list[Request], max_steps: int = 2000) -> tuple[list[str], list[str], int]:
    """Run to completion; (admission order, finishing order, steps that scheduled nothing)."""
    for r in reqs:
        s.add(r)
    admitted: list[str] = []  # in order of first admission
    finished: list[str] = []
    idle = 0
    for _ in range(max_steps):
        if not s.has_work():
            break
        out = s.schedule()
        s.check_integrity()
        if out is None:
            idle += 1
            continue
        admitted += [x.request.request_id for x in out.seqs if x.request.request_id not in admitted]
        s.update(out, [7 if x.samples else None for x in out.seqs])
        for x in out.seqs:
            r = x.request
            if x.samples and r.num_output_tokens >= r.sampling_params.max_tokens:
                s.finish(r, "length")
                finished.append(r.request_id)
        s.check_integrity()
    assert not s.has_work(), "requests hang"
    return admitted, finished, idle


def queue(n: int = 6, size: int = 40) -> list[Request]:
    # arrival times reversed against ids, so FCFS order is distinguishable from id order
    return [req(f"r{i}", size + i, t=float(n - i)) for i in range(n)]


def fcfs_ids(reqs: list[Request]) -> list[str]:
    return [r.request_id for r in sorted(reqs, key=lambda r: r.arrival_time)]


class Recorder:
    """Stands in for the scheduler's logger (whichever logging set-up is in use)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __getattr__(self, level: str) -> Any:
        def emit(event: str, **fields: Any) -> None:
            self.events.append({"event": event, "log_level": level, **fields})

        return emit


@contextlib.contextmanager
def capture_logs() -> Iterator[list[dict[str, Any]]]:
    recorder = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy_guard_module, "log", recorder)
        yield recorder.events


def errors(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "scheduler.policy_error"]


# ---------------------------------------------------------------------- order_waiting faults
class Raises(SchedulingPolicy):
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        raise RuntimeError("policy bug")


class Stranger(SchedulingPolicy):
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        return [req("ghost", 10, t=0.0), *sorted(waiting, key=lambda r: r.request_id)]


class NotARequest(SchedulingPolicy):
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Any]:
        return [*sorted(waiting, key=lambda r: r.request_id), "r0"]


class Duplicates(SchedulingPolicy):
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        ordered = sorted(waiting, key=lambda r: r.request_id)
        return ordered + ordered[:1]


class Endless(SchedulingPolicy):
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> Any:
        return itertools.cycle(waiting)


class NotIterable(SchedulingPolicy):
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> Any:
        return None


class MutatesArgument(SchedulingPolicy):
    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        out = list(waiting)
        waiting.clear()  # type: ignore[attr-defined]  # the scheduler's queue must survive this
        return sorted(out, key=lambda r: r.arrival_time)


@pytest.mark.parametrize(
    ("policy", "fault"),
    [
        (Raises(), "raised"),
        (Stranger(), "unknown_item"),
        (NotARequest(), "unknown_item"),
        (Duplicates(), "duplicate"),
        (Endless(), "duplicate"),
        (NotIterable(), "bad_result"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_broken_ordering_falls_back_to_fcfs(policy: SchedulingPolicy, fault: str) -> None:
    s = make_scheduler(policy, seqs=1)  # one at a time: admission order is visible
    reqs = queue()
    with capture_logs() as logs:
        admitted, finished, idle = run(s, reqs)
    assert finished == fcfs_ids(reqs) and admitted == fcfs_ids(reqs)
    assert idle == 0
    # every ordering call (one per step while requests wait) is a counted fault
    assert s.stats()["scheduler.policy_errors"] >= len(reqs)
    logged = errors(logs)
    assert len(logged) == 1, logged  # once, however often it happens
    assert logged[0]["call"] == "order_waiting" and logged[0]["fault"] == fault
    assert logged[0]["log_level"] == "error"


def test_empty_ordering_forever_does_not_starve() -> None:
    class Empty(SchedulingPolicy):
        def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
            return []

    reqs = queue(8)
    s = make_scheduler(Empty(), seqs=4)
    with capture_logs() as logs:
        _, finished, idle = run(s, reqs)
    reference = make_scheduler(FCFSPolicy(), seqs=4)
    _, fcfs_finished, _ = run(reference, queue(8))
    assert finished == fcfs_finished and idle == 0
    assert s.step_count == reference.step_count  # no empty spinning while requests wait
    assert s.policy_errors > 0
    assert [(e["call"], e["fault"]) for e in errors(logs)] == [("order_waiting", "omitted")]


def test_partial_ordering_keeps_its_prefix_then_fcfs() -> None:
    class LastOnly(SchedulingPolicy):
        def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
            return [max(waiting, key=lambda r: r.request_id)]

    reqs = queue(5)
    s = make_scheduler(LastOnly(), seqs=1)
    with capture_logs():
        admitted, _, _ = run(s, reqs)
    # each step: the policy's pick first, then the rest in FCFS order; r4 is picked first
    assert admitted[0] == "r4"
    assert s.policy_errors > 0


def test_policy_mutating_its_argument_cannot_corrupt_the_queue() -> None:
    reqs = queue()
    s = make_scheduler(MutatesArgument(), seqs=1)
    admitted, finished, _ = run(s, reqs)
    assert finished == fcfs_ids(reqs) and s.policy_errors == 0


def test_fault_on_some_steps_only_keeps_the_policy_elsewhere() -> None:
    """Per-call fallback: a policy that fails once is used again on the next step."""

    class FlakyPriority(SchedulingPolicy):
        calls = 0

        def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
            self.calls += 1
            if self.calls == 1:
                raise ValueError("first call only")
            return sorted(waiting, key=lambda r: r.priority)

    reqs = [req(f"p{i}", 30, t=float(i), prio=-i) for i in range(5)]  # later arrival, better priority
    s = make_scheduler(FlakyPriority(), seqs=1)
    with capture_logs():
        admitted, _, _ = run(s, reqs)
    assert admitted == ["p0", "p4", "p3", "p2", "p1"]  # FCFS once, then the policy again
    assert s.policy_errors == 1


# ---------------------------------------------------------------------- preemption_victim faults
class VictimRaises(FCFSPolicy):
    def preemption_victim(self, candidates: Sequence[Request], ctx: PolicyContext) -> Request:
        raise KeyError("victim bug")


class VictimStranger(FCFSPolicy):
    def preemption_victim(self, candidates: Sequence[Request], ctx: PolicyContext) -> Request:
        return req("ghost", 10, t=0.0)


class VictimNone(FCFSPolicy):
    def preemption_victim(self, candidates: Sequence[Request], ctx: PolicyContext) -> Any:
        return None


@pytest.mark.parametrize(
    ("policy", "fault"),
    [(VictimRaises(), "raised"), (VictimStranger(), "not_a_candidate"), (VictimNone(), "not_a_candidate")],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_broken_victim_choice_falls_back_to_latest_arrival(policy: SchedulingPolicy, fault: str) -> None:
    def pressure() -> list[Request]:
        return [req(f"v{i}", 100 + 10 * i, t=float(i), max_tokens=40) for i in range(10)]

    s = make_scheduler(policy, blocks=48, budget=256)
    with capture_logs() as logs:
        _, finished, _ = run(s, pressure(), max_steps=5000)
    reference = make_scheduler(FCFSPolicy(), blocks=48, budget=256)
    _, fcfs_finished, _ = run(reference, pressure(), max_steps=5000)
    assert s.num_preemptions == reference.num_preemptions > 0
    assert finished == fcfs_finished  # the fallback is FCFS's victim: the same run
    assert 0 < s.policy_errors <= s.num_preemptions  # one per victim asked for
    assert [(e["call"], e["fault"]) for e in errors(logs)] == [("preemption_victim", fault)]


def test_victim_that_is_a_waiting_request_is_rejected() -> None:
    """A request that exists but was not offered (here: a waiting one) is not a victim."""

    class WaitingVictim(FCFSPolicy):
        def __init__(self) -> None:
            self.scheduler: Scheduler | None = None

        def preemption_victim(self, candidates: Sequence[Request], ctx: PolicyContext) -> Request:
            assert self.scheduler is not None
            return self.scheduler.waiting[0] if self.scheduler.waiting else req("ghost", 10, t=0.0)

    policy = WaitingVictim()
    s = make_scheduler(policy, blocks=48, budget=256)
    policy.scheduler = s
    reqs = [req(f"w{i}", 100 + 10 * i, t=float(i), max_tokens=40) for i in range(12)]
    with capture_logs():
        _, finished, _ = run(s, reqs, max_steps=5000)
    assert sorted(finished) == sorted(r.request_id for r in reqs)
    assert s.policy_errors > 0


# ---------------------------------------------------------------------- stats faults
def test_broken_policy_stats_do_not_break_scheduler_stats() -> None:
    class BadStats(FCFSPolicy):
        def stats(self) -> Any:
            raise RuntimeError("stats bug")

    class OddStats(FCFSPolicy):
        def stats(self) -> Any:
            return {"ok": 1.5, "text": "nope", 3: 1}

    with capture_logs() as logs:
        s = make_scheduler(BadStats())
        assert s.stats()["scheduler.policy_errors"] == 1
        assert s.stats()["scheduler.policy_errors"] == 2
        s = make_scheduler(OddStats())
        stats = s.stats()
    assert stats["scheduler.policy.ok"] == 1.5 and stats["scheduler.policy_errors"] == 2
    assert not any(k.startswith("scheduler.policy.") and k != "scheduler.policy.ok" for k in stats)
    assert [(e["call"], e["fault"]) for e in errors(logs)] == [("stats", "raised"), ("stats", "bad_entry")]


# ---------------------------------------------------------------------- priority arithmetic
@pytest.mark.parametrize("huge", [10**400, -(10**400), 2**63, -(2**63) - 1])
def test_any_int_priority_is_safe(huge: int) -> None:
    s = make_scheduler(make_policy("priority", {"aging_steps": 4}), seqs=2, blocks=48, budget=256)
    reqs = [req(f"h{i}", 60 + 10 * i, t=float(i), prio=huge if i % 2 else i, max_tokens=30) for i in range(8)]
    with capture_logs() as logs:
        _, finished, _ = run(s, reqs, max_steps=5000)
    assert sorted(finished) == sorted(r.request_id for r in reqs)
    assert s.policy_errors == 0 and not errors(logs)
    # the order still follows the priorities exactly
    ctx = PolicyContext(step=10**6, now=0.0, cached_prefix=lambda r: 0)
    p = make_policy("priority")
    a, b = req("a", 5, t=0.0, prio=huge), req("b", 5, t=1.0, prio=huge - 1)
    assert [r.request_id for r in p.order_waiting([a, b], ctx)] == ["b", "a"]


def test_the_real_logger_takes_the_event() -> None:
    s = make_scheduler(Raises(), seqs=1)
    _, finished, _ = run(s, queue(2))
    assert len(finished) == 2 and s.policy_errors > 0
