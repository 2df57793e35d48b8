"""The public step-phase hook (``engine/core/step_phases.py``): ``EngineCore(phases=...)`` sees
every phase of a step in order, on the thread doing it, with the overlapped loop's forward on
its worker; the default recorder is a no-op shared by the runner and the scheduler."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from deltaserve.engine import EngineCore
from deltaserve.engine.core.step_phases import PHASES, StepPhases, TimedPhases
from deltaserve.models import LoadedModel
from tests.engine.conftest import greedy, make_config, run_to_completion


class Log(StepPhases):
    """Every call, with the thread that made it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (thread name, phase or "close")

    def enter(self, phase: str) -> None:
        self.calls.append((threading.current_thread().name, phase))

    def close(self) -> None:
        self.calls.append((threading.current_thread().name, "close"))


def _decoding(core: EngineCore, num: int) -> None:
    """``num`` requests admitted and past their prefill (each decodes 20 tokens)."""
    for i in range(num):
        core.add_request(core.make_request([5 + i, 6, 7, 8], greedy(20)))
    for _ in range(4):
        core.step()


def test_a_plain_step_enters_every_phase_in_order(tiny_loaded: LoadedModel) -> None:
    log = Log()
    core = EngineCore(make_config(), loaded=tiny_loaded, phases=log)
    assert core.phases is log and core.runner.phases is log and core.scheduler.phases is log
    _decoding(core, 2)
    log.calls.clear()
    core.step()  # a decode step
    main = threading.current_thread().name
    assert log.calls == [(main, p) for p in (
        "schedule", "cache_plan", "schedule", "build_batch", "forward", "sample", "close",
        "cache_commit", "outputs", "close",
    )]  # fmt: skip
    run_to_completion(core)
    core.close()


def test_the_overlapped_step_runs_forward_and_sample_on_its_worker(tiny_loaded: LoadedModel) -> None:
    log = Log()
    core = EngineCore(make_config(**{"engine.async_scheduling": True}), loaded=tiny_loaded, phases=log)
    _decoding(core, 2)
    log.calls.clear()
    core.step()
    core.step()
    main = threading.current_thread().name
    on_main = {p for t, p in log.calls if t == main}
    on_worker = [p for t, p in log.calls if t != main]
    assert on_main == {"cache_commit", "schedule", "cache_plan", "build_batch", "outputs", "close"}
    # (the worker may be inside a launch when the log is cleared: its calls from the next "forward" on)
    first = on_worker.index("forward")
    assert on_worker[first : first + 3] == ["forward", "sample", "close"]
    assert set(on_worker) == {"forward", "sample", "close"}
    assert {t for t, _ in log.calls if t != main} == {
        t for t, _ in log.calls if t.startswith("deltaserve-forward")
    }
    run_to_completion(core)
    core.close()


def test_timed_phases_sum_within_the_steps(
    core_factory: Callable[..., EngineCore], tiny_loaded: LoadedModel
) -> None:
    timed = TimedPhases()
    core = EngineCore(make_config(), loaded=tiny_loaded, phases=timed)
    _decoding(core, 3)
    timed.reset()
    t0 = time.perf_counter_ns()
    for _ in range(5):
        core.step()
    wall = time.perf_counter_ns() - t0
    assert set(timed.ns) == set(PHASES) and all(timed.ns[p] > 0 for p in PHASES)
    assert sum(timed.ns.values()) <= wall  # one thread: the phases never overlap
    run_to_completion(core)
    core.close()
    plain = core_factory()
    # the default: one no-op recorder, shared
    assert type(plain.phases) is StepPhases and plain.runner.phases is plain.phases is plain.scheduler.phases


def test_timed_phases_attribute_time_to_the_phase_entered_last() -> None:
    timed = TimedPhases()
    timed.enter("schedule")
    time.sleep(0.02)
    timed.enter("forward")
    time.sleep(0.01)
    timed.close()
    time.sleep(0.02)  # after close: in no phase
    timed.close()
    assert 20e6 <= timed.ns["schedule"] < 2e9 and 10e6 <= timed.ns["forward"] < 2e9
    assert set(timed.ns) == {"schedule", "forward"}
    timed.reset()
    timed.enabled = False
    timed.enter("sample")
    timed.close()
    assert dict(timed.ns) == {}
