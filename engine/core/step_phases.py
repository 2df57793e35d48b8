"""StepPhases: the public hook that says where an engine step's time goes.

``EngineCore(config, phases=recorder)`` installs a recorder; the engine calls
``recorder.enter(phase)`` at each phase boundary of a step and ``recorder.close()`` when the
step is over, on the thread doing the work. The default recorder (``StepPhases``) does nothing:
a step makes about ten such calls, a few hundred nanoseconds in all, against a step of
milliseconds. ``TimedPhases`` is the recorder that times them (``tools/bench/bench_overhead.py``
and ``tools/bench/profile_cpu.py`` use it); a recorder of one's own subclasses ``StepPhases``.

The phases (``PHASES``), in the order a plain step enters them:

* ``schedule``: the scheduler picks the step's sequences (and the step's copies between
  memory tiers run, before the forward)
* ``cache_plan``: the cache manager plans the step (``CacheManager.plan_step``: hits, captures,
  restores, evictions), inside the scheduler's pick
* ``build_batch``: the runner builds the step's host tensors (``ModelRunner.prepare``)
* ``forward``: the device step: input copy, state restores, the model, tracking copies
* ``sample``: token selection from the logits
* ``cache_commit``: the step's results are applied (``Scheduler.update``: computed counts,
  the cache plan committed, tokens appended)
* ``outputs``: each request's token turned into its output (stop checks, output objects)

Contract: ``enter`` ends the phase the calling thread was in (if any) and starts ``phase``;
``close`` ends it; time on a thread outside any phase is in no phase. With
``engine.async_scheduling`` the forward and sample phases run on the forward worker thread
while the engine thread schedules and builds the next step, so phases of different threads
overlap in time: their sum can exceed the step's wall time.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

PHASES = ("schedule", "cache_plan", "build_batch", "forward", "sample", "cache_commit", "outputs")


class StepPhases:
    """The no-op recorder: the engine's default. Subclass it to observe the phases."""

    def enter(self, phase: str) -> None:
        """The calling thread ends its current phase and starts ``phase`` (one of ``PHASES``)."""

    def close(self) -> None:
        """The calling thread ends its current phase (the step, or its part on this thread, is over)."""


class TimedPhases(StepPhases):
    """Nanoseconds per phase, summed over every thread and step since the last ``reset``.

    ``enabled`` False makes it record nothing (its calls still cost a little: a benchmark that
    wants the untouched step uses the default recorder instead)."""

    def __init__(self) -> None:
        self.ns: defaultdict[str, int] = defaultdict(int)
        self.enabled = True
        self._open = threading.local()  # this thread's (phase, start ns) or None

    def enter(self, phase: str) -> None:
        now = time.perf_counter_ns()
        self._end(now)
        self._open.current = (phase, now) if self.enabled else None

    def close(self) -> None:
        self._end(time.perf_counter_ns())
        self._open.current = None

    def _end(self, now: int) -> None:
        current = getattr(self._open, "current", None)
        if current is not None:
            self.ns[current[0]] += now - current[1]

    def reset(self) -> None:
        """Forget the sums (call it between steps: a phase open now adds its whole length)."""
        self.ns = defaultdict(int)
