"""ProcCoreClient: the core client (``engine/front/core_client.py``) of a core in another process.

``start`` spawns the core process (``engine/core/core_proc.py``; a fresh interpreter) and says
hello over ZeroMQ (``engine/messages.py``); ``ProcCoreClient(config, address=...)`` joins a core
another process started (``--api-server-count``): it does not own it and never shuts it down.
What this front end sends it has validated; its core request ids carry a tag of its own
(``TAG:N``), so front ends sharing a core never collide. A reader task hands each
``StepOutputs`` to the front end; a watcher task polls the core's liveness.

Faults: the core process dying (or the reader failing) tells the front end once (``on_dead``);
waiting stats, compiles and integrity checks fail with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from typing import TYPE_CHECKING, Any

import msgspec

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.core.ipc_files import pid_alive
from deltaserve.engine.errors import ConfigError, EngineDeadError, InvalidRequestError
from deltaserve.engine.front.core_client import check_waiting
from deltaserve.engine.grammar import timeout_error
from deltaserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CheckIntegrity,
    CompileConstraint,
    ConstraintCompiled,
    CoreMessage,
    GetStats,
    Hello,
    IntegrityChecked,
    Ready,
    Shutdown,
    StartFailed,
    StepOutputs,
)
from deltaserve.engine.model_files import check_model
from deltaserve.logs import get_logger

if TYPE_CHECKING:
    from deltaserve.engine.constraint import Constraint
    from deltaserve.engine.core.core_proc import CoreHandle
    from deltaserve.engine.front.core_client import OutputSink
    from deltaserve.engine.front.input_processor import InputProcessor

log = get_logger("deltaserve.engine")

#: how often the front end checks that the core process is alive
WATCH_INTERVAL_S = 0.1
#: how long ``start()`` waits for the core to load the model and answer
START_TIMEOUT_S = 600.0
#: how long ``shutdown()`` waits for the core to abort what is left and exit
STOP_TIMEOUT_S = 60.0


class ProcCoreClient:
    """``CoreClient`` over an engine core in its own process (module docstring)."""

    input_processor: InputProcessor | None = None  # the front end builds its own

    def __init__(self, config: EngineConfig, *, address: str | None = None) -> None:
        self.config = config
        self.address = address  # None: spawn a core and own it
        self.owner = address is None
        self.handle: CoreHandle | None = None
        self.core_pid: int | None = None
        self._tag = f"{os.getpid()}-{os.urandom(3).hex()}"  # core ids of this front end: TAG:N
        self._sink: OutputSink | None = None
        self._seq = itertools.count()
        self._ctx: Any = None
        self._sock: Any = None
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(CoreMessage)
        self._stats: dict[str, Any] = {}
        self._stats_waiters: list[tuple[float, asyncio.Future[dict[str, Any]]]] = []
        self._compiles: dict[int, asyncio.Future[str | None]] = {}  # CompileConstraint token -> answer
        self._checks: dict[int, asyncio.Future[str | None]] = {}  # CheckIntegrity token -> answer
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self._dead: str | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self, sink: OutputSink) -> Ready:
        """Spawn the core (unless joining one), say hello, wait until it is ready."""
        import zmq
        import zmq.asyncio

        # one-line ConfigErrors for the model path (a hub id may download), max_model_len and the
        # model's files before the core process is spawned; a downloaded path is pinned here
        await asyncio.get_running_loop().run_in_executor(None, check_model, self.config)
        if self.owner:
            from deltaserve.engine.core.core_proc import start_core

            self.handle = start_core(self.config)
            self.address = self.handle.address
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.address)
        try:
            ready = await self._hello()
        except BaseException:
            await self._stop_core(kill=True)
            # an open socket keeps its context's term() (run by the garbage collector, too) waiting
            self._sock.close(linger=0)
            self._ctx.term()
            self._sock = None
            raise
        self._sink = sink
        self.core_pid = ready.pid
        self._stats = ready.stats
        self._started = True
        self._tasks = [
            asyncio.create_task(self._read(), name="deltaserve-proc-read"),
            asyncio.create_task(self._watch(), name="deltaserve-proc-watch"),
        ]
        log.info("engine_proc.ready", core_pid=self.core_pid, owner=self.owner, address=self.address)
        return ready

    async def _hello(self) -> Ready:
        await self._sock.send(self._enc.encode(Hello(os.getpid(), self.owner)))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not await self._sock.poll(100):
            if self.handle is not None and not self.handle.alive():
                raise EngineDeadError(
                    f"the engine core process exited with code {self.handle.exitcode} at start"
                )
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine core did not answer within {START_TIMEOUT_S:.0f} s")
        msg = self._dec.decode(await self._sock.recv())
        if isinstance(msg, StartFailed):
            if msg.kind == "ConfigError":
                raise ConfigError(msg.message)
            raise EngineDeadError(f"the engine core failed to start: {msg.kind}: {msg.message}")
        if not isinstance(msg, Ready):
            raise EngineDeadError(f"the engine core answered hello with {type(msg).__name__}")
        return msg

    async def shutdown(self) -> None:
        """Stop the core if this client owns it (after it has aborted what is left and closed its
        engine), close the socket. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.owner and self._dead is None and self._sock is not None:
            self._send(Shutdown())
        await self._stop_core(kill=False)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        if self._sock is not None:
            # a live core gets the aborts queued before; nothing waits on a dead one
            self._sock.close(linger=0 if self._dead is not None else 1000)
            self._ctx.term()
            self._sock = None

    async def _stop_core(self, *, kill: bool) -> None:
        if self.handle is None:
            return
        if kill:
            self.handle.kill()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.handle.join, STOP_TIMEOUT_S)
        if self.handle.alive():
            log.error("engine_proc.core_kill", pid=self.handle.pid, after_s=STOP_TIMEOUT_S)
            self.handle.kill()
            await loop.run_in_executor(None, self.handle.join, 5.0)

    def is_healthy(self) -> bool:
        """Started, not shut down, and the core process alive."""
        return self._started and not self._closed and self._dead is None

    # ------------------------------------------------------------------ requests
    def core_ids(self, request_id: str, n: int) -> list[str]:
        """``TAG:N``: front ends sharing the core never collide on a user's request id."""
        return [f"{self._tag}:{next(self._seq)}" for _ in range(n)]

    def add_requests(self, adds: list[AddRequest]) -> None:
        # DEALER with no high-water mark: each send queues at once, never blocks the event loop
        if self._sock is not None and self._dead is None:
            for a in adds:
                self._send(a)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self._dead is None and self._sock is not None:
            self._send(AbortRequests(request_ids))

    def check_capacity(self, n: int) -> None:
        """From the core's last stats (at most ``STATS_INTERVAL_S`` old while it works)."""
        s = self._stats
        waiting = int(s.get("scheduler.waiting", 0)) + int(s.get("grammar.parked", 0)) + n - 1
        check_waiting(waiting, self.config.scheduler.max_waiting)

    # ------------------------------------------------------------------ asking the core
    def stats(self) -> dict[str, Any]:
        """The core's stats as last sent (every ``STATS_INTERVAL_S`` while it works, and when it
        goes idle); ``core.pid`` and ``core.cpu_s`` (its process CPU time) among them."""
        return dict(self._stats)

    async def fetch_stats(self) -> dict[str, Any]:
        """The core's stats taken now (after everything this front end sent before the call)."""
        self._check_alive()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append((time.time(), fut))
        self._send(GetStats())
        return await fut

    async def check_integrity(self) -> None:
        """Checked in the core between two steps; its ``AssertionError`` message when broken."""
        self._check_alive()
        token = next(self._seq)
        fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._checks[token] = fut
        try:
            self._send(CheckIntegrity(token))
            error = await fut
        finally:
            self._checks.pop(token, None)
        if error is not None:
            raise AssertionError(error)

    async def compile_constraint(self, constraint: Constraint) -> None:
        """The core's grammar workers compile (its loop goes on); waits at most
        ``structured_outputs.compile_timeout_s``."""
        self._check_alive()
        token = next(self._seq)
        fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._compiles[token] = fut
        timeout_s = self.config.structured_outputs.compile_timeout_s
        try:
            self._send(CompileConstraint(token, constraint))
            done, _ = await asyncio.wait({fut}, timeout=timeout_s)
        finally:
            self._compiles.pop(token, None)
        if not done:
            raise timeout_error(timeout_s)
        error = fut.result()
        if error is not None:
            raise InvalidRequestError(error)

    # ------------------------------------------------------------------ plumbing
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self.is_healthy():
            raise EngineDeadError("engine is not running (use `async with AsyncEngine(config) as engine`)")

    def _send(self, msg: Any) -> None:
        self._sock.send(self._enc.encode(msg))

    async def _read(self) -> None:
        """Hand the core's step outputs to the front end; a reader that fails is as bad as a
        dead core for this front end (no output would reach a stream again)."""
        try:
            await self._route_outputs()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to every open stream
            log.exception("engine_proc.read_failed")
            self._die(f"reading the engine core's outputs failed: {type(e).__name__}: {e}")

    async def _route_outputs(self) -> None:
        sock, dec = self._sock, self._dec
        sink = self._sink
        assert sink is not None
        while True:
            msg = dec.decode(await sock.recv())
            if isinstance(msg, StepOutputs):
                if msg.stats is not None:
                    self._stats = msg.stats
                    if self._stats_waiters:
                        self._answer_stats(msg.stats)
                if msg.deltas:
                    sink.on_outputs(msg)
            elif isinstance(msg, (ConstraintCompiled, IntegrityChecked)):
                waiting = self._compiles if isinstance(msg, ConstraintCompiled) else self._checks
                fut = waiting.get(msg.token)
                if fut is not None and not fut.done():
                    fut.set_result(msg.error)

    def _answer_stats(self, stats: dict[str, Any]) -> None:
        taken = float(stats.get("time", 0.0))
        waiting = []
        for asked, fut in self._stats_waiters:
            if fut.done():
                continue
            if taken >= asked:
                fut.set_result(dict(stats))
            else:
                waiting.append((asked, fut))
        self._stats_waiters = waiting

    async def _watch(self) -> None:
        """Poll the core's liveness; its death is reported once."""
        while not self._closed:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.handle is not None:
                alive = self.handle.alive()
                code = self.handle.exitcode
            else:
                alive, code = pid_alive(self.core_pid or 0), None
            if not alive and not self._closed:
                self._die(f"the engine core process (pid {self.core_pid}) died (exit code {code})")
                return

    def _die(self, message: str) -> None:
        if self._dead is not None:
            return
        self._dead = message
        log.error("engine_proc.core_died", error=message)
        for _, fut in self._stats_waiters:
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        self._stats_waiters = []
        for fut in [*self._compiles.values(), *self._checks.values()]:
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        if self._sink is not None:
            self._sink.on_dead(message)
