"""The engine-core process: one ``EngineCore`` (scheduler, cache, model, sampling) in a process
of its own, serving front ends (``AsyncEngine`` over ``ProcCoreClient``,
``engine/front/proc_core.py``) over a ZeroMQ ROUTER socket.

``start_core(config)`` starts it (a fresh interpreter, never a fork: torch and CUDA do not
survive one) and returns a ``CoreHandle``. Its loop is the core loop (``engine/core/core_loop.py``: burst
window, back-off, stats lines, as in every placement), single-threaded here: take every message
waiting (adds, aborts, hellos), run one step if there is work, send each front end one
``StepOutputs`` of token ids for the step (``engine/messages.py``); block on the socket when idle. Grammars compile
on the engine's grammar workers, never on this loop: a ``CompileConstraint`` is answered when its
compile is done, and a request whose grammar is still compiling waits parked (``EngineCore``);
a worker that finishes wakes the loop through a pipe.

The core never detokenizes (no core does): stop strings and text are the front end's work; it
aborts a request a stop string ended.

Lifetime: the owning front end's ``Shutdown`` ends the loop (what is left is aborted, the engine
closed: exit 0); so does the death of the process that spawned the core. SIGINT and SIGTERM are
ignored here: the front end drains on them and then shuts the core down. A front end that
dies (its pid gone) has its requests aborted; the core and the other front ends go on. A loop
that raises (a step's fault outside any one request) ends every open request with ``error``
("engine loop died: ..."), closes the engine and exits 1.

Diagnostics and testing: ``CheckIntegrity`` runs ``EngineCore.check_integrity()`` between two
steps. The environment variable ``DELTASERVE_CORE_HOOK=module:function`` (inherited from the
process that starts the core) names a function called with the ``CoreServer`` once the engine is
built, before it serves: the fault tests inject their faults into a real core process with it
(tests/reliability/core_hooks.py). It is logged as a warning; a hook that fails to import or
raises fails the start (``StartFailed``).

The socket file (``engine/core/ipc_files.py``): a private folder of the run in the temp folder; the
core removes it as it exits, its starter when it sees the core gone (``CoreHandle``: a killed
core cannot), a new start those of runs whose processes are all gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import math
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.constraint import trusted_decode
from deltaserve.engine.core.core_loop import CoreLoop
from deltaserve.engine.core.ipc_files import new_address, pid_alive, remove_address
from deltaserve.engine.errors import ConfigError
from deltaserve.engine.messages import (
    STATS_INTERVAL_S,
    AbortRequests,
    AddRequest,
    CheckIntegrity,
    CompileConstraint,
    ConstraintCompiled,
    FrontMessage,
    GetStats,
    Hello,
    IntegrityChecked,
    Shutdown,
    StartFailed,
    StepOutputs,
    TokenDelta,
    request_of,
)
from deltaserve.logs import configure_logging, get_logger

log = get_logger("deltaserve.engine")

#: how often the core checks that its parent and its front ends are alive
WATCH_INTERVAL_S = 0.5
#: ``module:function`` called with the ``CoreServer`` before it serves (module docstring)
HOOK_ENV = "DELTASERVE_CORE_HOOK"


def run_hook(loop: CoreServer) -> None:
    """Call the function ``DELTASERVE_CORE_HOOK`` names (if set) with ``loop``."""
    spec = os.environ.get(HOOK_ENV, "")
    if not spec:
        return
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"{HOOK_ENV} = {spec!r}: expected module:function")
    log.warning("core_proc.hook", hook=spec)
    getattr(importlib.import_module(module), name)(loop)


@dataclass
class FrontEnd:
    """A connected front end: its pid and the core ids of its open requests."""

    pid: int
    requests: set[str] = field(default_factory=set)


class CoreServer:
    """The core process (module docstring): the engine, its socket, its front ends; the port of
    its core loop (``engine/core/core_loop.py``). ``run()`` returns the exit code."""

    idle_period_s: float | None = WATCH_INTERVAL_S  # an idle core still watches its peers

    def __init__(self, config: EngineConfig, address: str, parent_pid: int) -> None:
        import zmq

        self.config = config
        self.address = address
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        # a ROUTER drops what passes its high-water mark: outputs must never be lost
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.bind(address)
        # a grammar worker writes a byte here when a compile finishes; the loop polls it with the socket
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.wake_r, zmq.POLLIN)
        # CompileConstraint messages whose compile is running: (front end, token, the compile)
        self.compiles: list[tuple[bytes, int, Future[Any]]] = []
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(FrontMessage)
        self.core: Any = None
        self.fronts: dict[bytes, FrontEnd] = {}
        self.owner_of: dict[str, bytes] = {}  # core request id -> the front end's identity
        self.stop = False
        self.last_stats = 0.0
        self.last_watch = time.monotonic()

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        from deltaserve.engine.core.engine_core import EngineCore

        try:
            self.core = EngineCore(self.config)
            run_hook(self)
        except Exception as e:  # noqa: BLE001 - reported to the front end that waits for Ready
            # a ConfigError is the user's to fix and the front end prints it (one line); logging
            # it here too printed it twice. Anything else is ours: logged where it happened.
            if isinstance(e, ConfigError):
                log.debug("core_proc.start_failed", error=repr(e))
            else:
                log.error("core_proc.start_failed", error=repr(e))
            self._answer_start_failure(e)
            return 1
        self.core.on_grammar_ready = self._wake
        log.info("core_proc.ready", pid=os.getpid(), address=self.address)
        # Everything built so far (model, tokenizer, cache bookkeeping) lives as long as the
        # process: out of the collector's sight, a full collection walks only what steps make.
        gc.collect()
        gc.freeze()
        died: str | None = None
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - every open request is told, then exit 1
            log.error("core_proc.loop_died", error=repr(e), exc_info=e)
            died = f"engine loop died: {e!r}"
        finally:
            self._finish(died)
        return 0 if died is None else 1

    def _answer_start_failure(self, error: Exception) -> None:
        """Tell the front ends that say hello within a few seconds why the engine did not start."""
        failed = self.enc.encode(StartFailed(type(error).__name__, str(error)))
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and self.sock.poll(100):
            ident, _ = self.sock.recv_multipart()
            self.sock.send_multipart([ident, failed])
            return

    def _finish(self, died: str | None = None) -> None:
        """Abort what is left (front ends get the outputs: ``error`` with ``died`` when the loop
        died), close the engine and the socket."""
        try:
            if self.core is not None:
                outputs = self.core.abort_all()
                if died is not None:
                    for out in outputs:
                        if out.finish_reason == "abort":
                            out.finish_reason, out.error = "error", died
                self._send(outputs, stats=True)
                self.core.close()
        finally:
            self.sock.close()
            self.ctx.term()
            os.close(self.wake_r)
            os.close(self.wake_w)
            # the engine's objects were frozen at start (run): unfrozen, the collector frees them
            # now, before the interpreter tears down the native modules they use (triton,
            # xgrammar: each object still alive then is a "nanobind: leaked ..." line)
            self.core = None
            gc.unfreeze()
            gc.collect()
            log.info("core_proc.stopped", pid=os.getpid())

    # ------------------------------------------------------------------ the loop's port
    def _loop(self) -> None:
        """The core loop (``engine/core/core_loop.py``) with this process as its port: on this one
        thread, its waits are polls of the socket (the event loop never runs anything else)."""
        loop = CoreLoop(self.core, self, self.config.logging.stats_interval_s)
        asyncio.run(loop.run())

    def stopped(self) -> bool:
        return self.stop

    def take(self) -> None:
        if self._poll(0):
            self._receive()
        self._chores()

    async def wait(self, timeout: float | None) -> None:
        if self._poll(-1 if timeout is None else max(1, math.ceil(timeout * 1000))):
            self._receive()
        self._chores()

    async def step(self) -> list[TokenDelta]:
        return self.core.step()

    def emit(self, outputs: list[TokenDelta]) -> None:
        self._send(outputs, stats=False)

    def went_idle(self) -> None:
        self._send([], stats=True)  # the front ends see the last stats at once

    def _chores(self) -> None:
        """Answer the compiles that are done; watch the parent and the front ends."""
        if self.compiles:
            self._answer_compiles()
        self._watch()

    def _poll(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for a message or a grammar worker's wake-up; whether a
        message waits."""
        events = dict(self.poller.poll(timeout_ms))
        if self.wake_r in events:
            with contextlib.suppress(BlockingIOError):
                while os.read(self.wake_r, 4096):
                    pass
        return self.sock in events

    def _wake(self) -> None:
        """(A grammar worker's thread) make the loop's poll return."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.wake_w, b"w")

    def _receive(self) -> None:
        import zmq

        while True:
            try:
                ident, data = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                with trusted_decode():  # validated by the front end: not checked again
                    msg = self.dec.decode(data)
            except msgspec.DecodeError as e:
                log.error("core_proc.bad_message", error=str(e))
                continue
            self._apply(ident, msg)

    def _apply(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            self._add(ident, msg)
        elif isinstance(msg, AbortRequests):
            outs = [
                self.core.abort_request(rid) for rid in msg.request_ids if self.owner_of.get(rid) == ident
            ]
            self._send([o for o in outs if o is not None], stats=False)
        elif isinstance(msg, Hello):
            self.fronts[ident] = FrontEnd(msg.pid)
            ready = self.core.ready(self._stats())
            self.sock.send_multipart([ident, self.enc.encode(ready)])
            log.info("core_proc.front_end", pid=msg.pid, owner=msg.owner, front_ends=len(self.fronts))
        elif isinstance(msg, CompileConstraint):
            fut = self.core.grammars.compile_async(msg.constraint)
            self.compiles.append((ident, msg.token, fut))
            if fut.done():
                self._answer_compiles()
            else:
                fut.add_done_callback(lambda _: self._wake())
        elif isinstance(msg, CheckIntegrity):
            try:
                self.core.check_integrity()
                error = None
            except AssertionError as e:
                error = str(e) or "integrity check failed"
            self.sock.send_multipart([ident, self.enc.encode(IntegrityChecked(msg.token, error))])
        elif isinstance(msg, GetStats):
            self.sock.send_multipart([ident, self.enc.encode(StepOutputs([], self._stats()))])
        elif isinstance(msg, Shutdown):
            log.info("core_proc.shutdown", front_ends=len(self.fronts))
            self.stop = True

    def _add(self, ident: bytes, msg: AddRequest) -> None:
        """Queue a front end's request: validated, its id unique and admitted there."""
        front = self.fronts.get(ident)
        if front is None:  # a front end that never said hello: nobody to answer
            log.error("core_proc.unknown_front_end", request_id=msg.request_id)
            return
        req = request_of(msg)
        self.owner_of[req.request_id] = ident
        front.requests.add(req.request_id)
        try:
            self.core.add_request(req)
        except Exception as e:  # noqa: BLE001 - ends this request only
            self._send([self.core.final_delta(req, "error", error=f"{type(e).__name__}: {e}")], stats=False)

    def _answer_compiles(self) -> None:
        """Answer each ``CompileConstraint`` whose compile is done."""
        waiting = []
        for ident, token, fut in self.compiles:
            if not fut.done():
                waiting.append((ident, token, fut))
                continue
            error = fut.exception()
            answer = ConstraintCompiled(token, None if error is None else str(error))
            if ident in self.fronts:
                self.sock.send_multipart([ident, self.enc.encode(answer)])
        self.compiles = waiting

    def _watch(self) -> None:
        """Every ``WATCH_INTERVAL_S``: stop if the parent died; abort a dead front end's requests."""
        now = time.monotonic()
        if now - self.last_watch < WATCH_INTERVAL_S:
            return
        self.last_watch = now
        if os.getppid() != self.parent_pid:
            log.error("core_proc.parent_died", parent=self.parent_pid)
            self.stop = True
            return
        for ident, front in list(self.fronts.items()):
            if pid_alive(front.pid):
                continue
            log.warning("core_proc.front_end_gone", pid=front.pid, open_requests=len(front.requests))
            del self.fronts[ident]
            for rid in front.requests:
                self.owner_of.pop(rid, None)
                self.core.abort_request(rid)  # nobody reads the output

    # ------------------------------------------------------------------ outputs
    def _stats(self) -> dict[str, Any]:
        s = self.core.stats()
        s["core.pid"] = os.getpid()
        s["core.cpu_s"] = time.process_time()
        return s

    def _send(self, outputs: list[TokenDelta], *, stats: bool) -> None:
        """One ``StepOutputs`` per front end with deltas (all of them when stats are due)."""
        by_front: dict[bytes, list[TokenDelta]] = defaultdict(list)
        for out in outputs:
            rid = out.request_id
            ident = self.owner_of.get(rid)
            if ident is None:
                continue
            by_front[ident].append(out)
            if out.finished:
                del self.owner_of[rid]
                front = self.fronts.get(ident)
                if front is not None:
                    front.requests.discard(rid)
        now = time.monotonic()
        snapshot = None
        if stats or now - self.last_stats >= STATS_INTERVAL_S:
            snapshot = self._stats()
            self.last_stats = now
            for ident in self.fronts:
                by_front.setdefault(ident, [])
        for ident, deltas in by_front.items():
            self.sock.send_multipart([ident, self.enc.encode(StepOutputs(deltas, snapshot))])


def run_core(argv: list[str]) -> int:
    """The core process's entry point (``python -m deltaserve.engine.core.core_proc ADDRESS PARENT_PID``,
    the config as JSON on stdin): ignore SIGINT/SIGTERM (the front end drains, then shuts the
    core down), log to stderr, run the loop; its exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    address, parent_pid = argv[0], int(argv[1])
    config = EngineConfig.from_dict(msgspec.json.decode(sys.stdin.buffer.read()))
    configure_logging(config.logging.level.value)
    try:
        return CoreServer(config, address, parent_pid).run()
    finally:
        remove_address(address)  # the core bound the socket: it removes it


class CoreHandle:
    """The core process, seen from the process that started it. Once it is seen to have exited
    (``alive``, ``exitcode``, ``join``), its ipc socket and run folder are removed
    (``remove_address``: a killed core leaves them)."""

    def __init__(self, process: subprocess.Popen[bytes], address: str) -> None:
        self.process = process
        self.address = address

    @property
    def pid(self) -> int:
        return self.process.pid

    def _poll(self) -> int | None:
        code = self.process.poll()
        if code is not None:
            remove_address(self.address)
        return code

    def alive(self) -> bool:
        return self._poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._poll()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        self._poll()

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()


def start_core(config: EngineConfig, address: str | None = None) -> CoreHandle:
    """Start the engine-core process for ``config`` on ``address`` (a fresh ipc:// address by
    default): a new interpreter (never a fork: torch and CUDA do not survive one, and a fresh
    interpreter does not re-import the application's ``__main__`` as multiprocessing's spawn does)."""
    address = address or new_address()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "deltaserve.engine.core.core_proc", address, str(os.getpid())],
            stdin=subprocess.PIPE,
        )
    except BaseException:
        remove_address(address)
        raise
    assert process.stdin is not None
    process.stdin.write(msgspec.json.encode(config.to_dict()))
    process.stdin.close()
    return CoreHandle(process, address)


if __name__ == "__main__":
    sys.exit(run_core(sys.argv[1:]))
