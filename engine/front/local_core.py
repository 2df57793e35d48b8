"""LocalCoreClient: the core client (``engine/front/core_client.py``) of a core in this process.

The ``EngineCore`` is built (``start``) or passed in (``core=``); the core loop
(``engine/core/core_loop.py``) runs as a task on the front end's event loop with this client as
its port: requests and aborts are applied in the order they were sent, between steps, on the
event loop; each step runs on one worker thread (the event loop stays responsive); each step's
deltas go to the front end as the event loop's next callback: the next step is on the worker
before the front end detokenizes this one's (the model's forward releases the GIL, so the two
overlap, as with a core process).

Faults: the loop dying for any reason (``BaseException`` included, or its task cancelled) tells
the front end once (``on_dead``: "engine loop died: ..."), fails waiting integrity checks with
``EngineDeadError``, and ``shutdown()`` still returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.core.core_loop import CoreLoop
from deltaserve.engine.errors import EngineDeadError
from deltaserve.engine.grammar import wait_compiled
from deltaserve.engine.messages import AddRequest, Ready, StepOutputs, TokenDelta, request_of
from deltaserve.logs import get_logger

if TYPE_CHECKING:
    from deltaserve.engine.constraint import Constraint
    from deltaserve.engine.core.engine_core import EngineCore
    from deltaserve.engine.front.core_client import OutputSink
    from deltaserve.engine.front.input_processor import InputProcessor
    from deltaserve.scheduler.request import Request

log = get_logger("deltaserve.engine")


class LocalCoreClient:
    """``CoreClient`` over an ``EngineCore`` in this process (module docstring). It is the
    core's only front end: core request ids are the user's."""

    idle_period_s: float | None = None  # the loop's port: an idle core sleeps until woken

    def __init__(self, config: EngineConfig, *, core: EngineCore | None = None) -> None:
        self.config = config
        self.core: EngineCore | None = core
        self.core_pid: int | None = None
        self._sink: OutputSink | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-step")
        # what the front end sent, in order: a request to add, or a request id to abort
        self._inbox: list[Request | str] = []
        self._pending_checks: list[asyncio.Future[None]] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._step: concurrent.futures.Future[list[TokenDelta]] | None = None
        self._closed = False
        self._in_step = False  # a step runs in the worker: the scheduler/cache are not ours to read
        self._last_stats: dict[str, Any] = {}
        self._dead: BaseException | None = None

    # ------------------------------------------------------------------ CoreClient
    @property
    def input_processor(self) -> InputProcessor | None:
        return self.core.input_processor if self.core is not None else None

    async def start(self, sink: OutputSink) -> Ready:
        """Build the core (on the worker thread, off the event loop) and start its loop."""
        loop = asyncio.get_running_loop()
        if self.core is None:
            from deltaserve.engine.core.engine_core import EngineCore

            self.core = await loop.run_in_executor(self._executor, EngineCore, self.config)
        self._sink = sink
        self._loop = loop
        self.core_pid = os.getpid()
        self._wakeup = asyncio.Event()
        # a parked request's grammar compiled (on a grammar worker): step again now
        self.core.on_grammar_ready = lambda: loop.call_soon_threadsafe(self._wake)
        self._task = asyncio.create_task(self._run(), name="deltaserve-engine-loop")
        self._task.add_done_callback(self._on_loop_done)
        return self.core.ready(self.core.stats())

    def core_ids(self, request_id: str, n: int) -> list[str]:
        """The user's id, and ``id.i`` for completion ``i > 0``."""
        return [request_id] + [f"{request_id}.{i}" for i in range(1, n)]

    def add_requests(self, adds: list[AddRequest]) -> None:
        self._inbox.extend(request_of(a) for a in adds)
        self._wake()

    def abort_requests(self, request_ids: list[str]) -> None:
        self._inbox.extend(request_ids)
        self._wake()

    def check_capacity(self, n: int) -> None:
        """Against the live queue, counting the adds the loop has not applied yet."""
        assert self.core is not None
        pending = sum(1 for item in self._inbox if not isinstance(item, str))
        self.core.check_capacity(pending=pending + n - 1)

    def stats(self) -> dict[str, Any]:
        """The core's counters; while a step runs, the snapshot taken after the previous one."""
        if self.core is None:
            return {}
        if self._in_step:
            return dict(self._last_stats)
        return self.core.stats()

    async def fetch_stats(self) -> dict[str, Any]:
        return self.stats()

    @property
    def in_step(self) -> bool:
        """A step runs in the worker thread: the scheduler and cache may change under a reader."""
        return self._in_step

    async def check_integrity(self) -> None:
        """The core's accounting, checked between two steps (at once when no loop runs)."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self.core is None:
            return
        if not self.is_healthy():  # not started, or shut down: nothing runs
            self.core.check_integrity()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending_checks.append(fut)
        self._wake()
        await fut

    async def compile_constraint(self, constraint: Constraint) -> None:
        """On the core's grammar workers, off the event loop."""
        assert self.core is not None
        grammars = self.core.grammars
        await wait_compiled(grammars.compile_async(constraint), grammars.timeout_s)

    def is_healthy(self) -> bool:
        """True while the engine loop runs and can serve requests."""
        return self._task is not None and not self._task.done() and self._dead is None and not self._closed

    async def shutdown(self) -> None:
        """Stop the loop, abort what the core still holds, close it, free the worker thread."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        if self._task is not None:
            await asyncio.wait([self._task])  # its failure was reported to the front end
        if self._step is not None and not self._step.done():
            # a step cut off by a dying loop still runs in the worker: let it finish first
            await asyncio.wait([asyncio.wrap_future(self._step)])
        self._inbox = []
        if self.core is not None:
            try:
                self.core.abort_all()  # the front end has ended every stream
            except Exception:
                if self._dead is None:
                    raise
                # the loop died (perhaps of a corrupt cache): its requests were already ended
                log.exception("engine.shutdown_cleanup_failed")
        self._resolve_checks(EngineDeadError("engine shut down"))
        if self.core is not None:
            # the forward worker of async scheduling, and the disk tier (closing it writes what
            # it lacks and flushes the store: in the worker); after a dead loop, best effort
            with contextlib.suppress(Exception) if self._dead is not None else contextlib.nullcontext():
                await asyncio.get_running_loop().run_in_executor(self._executor, self.core.close)
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ the loop's port
    def stopped(self) -> bool:
        return self._closed

    def take(self) -> None:
        core = self.core
        assert core is not None
        inbox, self._inbox = self._inbox, []
        dropped: list[TokenDelta] = []
        for item in inbox:
            if isinstance(item, str):
                core.abort_request(item)  # the front end ended it: its final delta is not needed
                continue
            try:
                core.add_request(item)
            except Exception as e:  # noqa: BLE001 - ends this request only
                dropped.append(core.final_delta(item, "error", error=f"{type(e).__name__}: {e}"))
        if dropped:
            self.emit(dropped)
        checks, self._pending_checks = self._pending_checks, []
        for fut in checks:
            try:
                core.check_integrity()
            except BaseException as e:  # noqa: BLE001 - reported to the caller, who asked
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        assert self._wakeup is not None
        # cleared before the check: a wake-up after it is kept, one before it is applied now
        self._wakeup.clear()
        if self._closed or self._inbox or self._pending_checks:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout=timeout)

    async def step(self) -> list[TokenDelta]:
        core = self.core
        assert core is not None
        self._in_step = True
        try:
            self._step = self._executor.submit(core.step)
            outputs = await asyncio.wrap_future(self._step)
        finally:
            self._in_step = False
        self._last_stats = core.stats()
        return outputs

    def emit(self, outputs: list[TokenDelta]) -> None:
        if outputs and self._sink is not None and self._loop is not None:
            # after the loop has handed the next step to the worker (it yields there)
            self._loop.call_soon(self._sink.on_outputs, StepOutputs(outputs))

    def went_idle(self) -> None:
        pass  # the front end has every delta already; stats() reads the core directly

    # ------------------------------------------------------------------ plumbing
    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run(self) -> None:
        assert self.core is not None
        loop = CoreLoop(self.core, self, self.config.logging.stats_interval_s)
        try:
            await loop.run()
        except BaseException as e:
            self._die(e)
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise  # keep the semantics of cancellation and interpreter exit

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        # covers a loop task cancelled before its body ever ran; retrieves the task's exception
        exc = asyncio.CancelledError("engine loop task cancelled") if task.cancelled() else task.exception()
        if not self._closed and self._dead is None:
            self._die(exc or RuntimeError("engine loop exited"))

    def _die(self, exc: BaseException) -> None:
        """The loop stopped for good: tell the front end, fail the waiting checks."""
        if self._dead is not None:
            return
        if self._closed and isinstance(exc, asyncio.CancelledError):
            return  # shutdown racing a cancel: the front end has ended its streams
        self._dead = exc
        log.error("engine.loop_died", error=repr(exc), exc_info=exc)
        message = f"engine loop died: {exc!r}"
        self._resolve_checks(EngineDeadError(message))
        if self._sink is not None:
            self._sink.on_dead(message)

    def _resolve_checks(self, error: Exception) -> None:
        for fut in self._pending_checks:
            if not fut.done():
                fut.set_exception(error)
        self._pending_checks = []
