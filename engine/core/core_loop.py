"""The core loop: one ``EngineCore`` driven turn after turn, the same in every placement.

``CoreLoop.run()`` is the only engine loop: an in-process core (``LocalCoreClient``, also in each
cluster replica) runs it as a task on the front end's event loop (the step on a worker thread),
the core process (``engine/core/core_proc.py``) runs it with
``asyncio.run`` on its one thread (its port never suspends but to poll the socket). Each turn::

    take inputs      the port applies what arrived (adds, aborts, integrity checks, hellos)
    idle?            no work: after a burst, the port is told once (``went_idle``); then it
                     waits for inputs (up to the port's own period and the stats interval)
    burst window     the first step after idle waits ``EngineCore.burst_window()`` for more
                     arrivals, so a burst is scheduled together
    step             ``port.step()`` runs ``EngineCore.step()`` (which gives the memory freed
                     since the last idle back to the OS when the step leaves no work)
    emit             ``port.emit(outputs)`` routes the step's outputs to their requests
    back off         a step that scheduled nothing and produced nothing (requests wait for
                     room): wait ``IDLE_RETRY_S`` for inputs rather than spin
    stats            every ``logging.stats_interval_s`` with work done in it: one ``engine.stats``
                     line (the same event and fields in every placement); none while idle

What differs between placements is only the ``LoopPort``: where inputs come from, how a
wait is done, where the step runs and where outputs go. The loop never swallows an
exception: its driver decides what a dead loop means.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from deltaserve.engine.messages import TokenDelta
from deltaserve.logs import get_logger

log = get_logger("deltaserve.engine")

#: a step that scheduled nothing (requests wait for room): wait this long before the next
IDLE_RETRY_S = 0.05


class LoopCore(Protocol):
    """What the loop reads of the engine (``EngineCore``)."""

    @property
    def step_count(self) -> int: ...
    def has_work(self) -> bool: ...
    def burst_window(self) -> float: ...
    def stats(self) -> dict[str, Any]: ...


class LoopPort(Protocol):
    """The placement's side of the loop. Every method runs on the loop's thread."""

    #: longest idle wait in seconds (the port's own chores, e.g. watching its peers); None: none
    idle_period_s: float | None

    def stopped(self) -> bool:
        """The loop ends before its next turn."""
        ...

    def take(self) -> None:
        """Apply every input that has arrived; never waits."""
        ...

    async def wait(self, timeout: float | None) -> None:
        """Wait until an input arrives or ``timeout`` seconds pass (None: no limit); inputs that
        arrived may be applied now or by the next ``take``."""
        ...

    async def step(self) -> list[TokenDelta]:
        """Run one ``EngineCore.step()``; its outputs."""
        ...

    def emit(self, outputs: list[TokenDelta]) -> None:
        """Hand a step's outputs (or an abort's) to their requests."""
        ...

    def went_idle(self) -> None:
        """The engine has no work left after doing some."""
        ...


class CoreLoop:
    """The engine loop of one core (module docstring)."""

    def __init__(self, core: LoopCore, port: LoopPort, stats_interval_s: float) -> None:
        self.core = core
        self.port = port
        self.stats_interval_s = stats_interval_s
        now = time.monotonic()
        self._last_log = now
        self._window_t0 = now  # the current stats window: since the last engine.stats line
        self._window_steps = 0
        self._window_tokens = 0  # outputs of the window's steps (a token each, or a request's end)

    async def run(self) -> None:
        core, port = self.core, self.port
        idle = True
        while not port.stopped():
            port.take()
            if port.stopped():
                break
            if not core.has_work():
                if not idle:
                    idle = True
                    port.went_idle()
                # a burst that ended within the interval still gets its line, one interval on
                self.maybe_log()
                await port.wait(self._idle_timeout())
                continue
            if idle:  # the first step after idle: let a burst of arrivals come in first
                idle = False
                if not self._window_steps:  # (the idle time before is no part of the rates)
                    self._window_t0 = time.monotonic()
                if await self._burst_window() and not core.has_work():
                    continue
            steps_before = self.core.step_count
            outputs = await port.step()
            port.emit(outputs)
            self._window_steps += 1
            self._window_tokens += len(outputs)
            self.maybe_log()
            if not outputs and self.core.step_count == steps_before:
                # requests wait but none could be scheduled (with async scheduling: nor was a
                # step in flight to finish): do not spin
                await port.wait(IDLE_RETRY_S)
            # Otherwise go straight on to the next step: the consumers (an SSE writer, a front
            # end in another process) handle this step's outputs while the next one runs.

    async def _burst_window(self) -> bool:
        """Wait the core's burst window for more arrivals, taking them; whether it waited."""
        window = self.core.burst_window()
        if window <= 0:
            return False
        deadline = time.monotonic() + window
        while (left := deadline - time.monotonic()) > 0 and not self.port.stopped():
            await self.port.wait(left)
            self.port.take()
        return True

    def _idle_timeout(self) -> float | None:
        """How long an idle loop waits: the port's period, and the stats line still owed."""
        timeouts = [self.port.idle_period_s]
        if self.stats_interval_s > 0 and self._window_steps:
            timeouts.append(max(self.stats_interval_s - (time.monotonic() - self._last_log), 0.001))
        found = [t for t in timeouts if t is not None]
        return min(found) if found else None

    def maybe_log(self) -> None:
        """One ``engine.stats`` line if the interval has passed and steps ran since the last."""
        interval = self.stats_interval_s
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval or not self._window_steps:
            return
        dt = now - self._window_t0
        s = self.core.stats()
        log.info(
            "engine.stats",
            gen_tok_s=round(self._window_tokens / dt, 1) if dt > 0 else 0.0,
            steps_s=round(self._window_steps / dt, 2) if dt > 0 else 0.0,
            running=s["scheduler.running"],
            waiting=s["scheduler.waiting"],
            kv_usage=round(s["kv.usage"], 3),
            hit_rate=round(s["prefix_cache.hit_rate"], 3),
            checkpoints=s["checkpoints.attached"],
            preemptions=s["scheduler.preemptions"],
            finished=s["requests.finished"],
            generated=s["tokens.generated"],
        )
        self._last_log = self._window_t0 = now
        self._window_steps = self._window_tokens = 0
