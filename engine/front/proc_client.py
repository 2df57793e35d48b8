"""EngineProcClient: an ``EngineClient`` whose engine core runs in another process.

::

    async with EngineProcClient(config) as engine:        # spawns the core process
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")

This process (the front end) validates and tokenizes (``InputProcessor``), detokenizes and
applies stop strings (``ProcStream``); the core process (``engine/core/core_proc.py``) schedules,
runs the model and samples, and sends token ids once per step over ZeroMQ
(``engine/messages.py``). ``EngineProcClient(config, address=...)`` joins a core another
process started (``--api-server-count``): it does not own it and never shuts it down.

Faults: the core process dying ends every open stream with ``error``, ``is_healthy()`` turns
False (``/health`` answers 503), ``generate`` raises ``EngineDeadError``, and each
``on_core_death`` callback runs once (``deltaserve serve`` exits non-zero then).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.constraint import Constraint
from deltaserve.engine.core.core_proc import CoreHandle, pid_alive, start_core
from deltaserve.engine.errors import ConfigError, EngineDeadError, EngineOverloadedError, InvalidRequestError
from deltaserve.engine.front.client import EngineClient, ModelInfo, RequestInput, not_started
from deltaserve.engine.front.detokenizer import IncrementalDetokenizer
from deltaserve.engine.front.input_processor import InputProcessor
from deltaserve.engine.front.proc_stream import Completion, ProcStream
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
from deltaserve.engine.model_files import (
    check_model,
    log_sampling_defaults,
    sampling_defaults,
    with_chat_template,
)
from deltaserve.engine.sampling_params import SEED_LIMIT, SamplingParams
from deltaserve.logs import get_logger

log = get_logger("deltaserve.engine")

#: how often the front end checks that the core process is alive
WATCH_INTERVAL_S = 0.1
#: how long ``start()`` waits for the core to load the model and answer
START_TIMEOUT_S = 600.0
#: how long ``shutdown()`` waits for the core to abort what is left and exit
STOP_TIMEOUT_S = 60.0


def child_params(params: SamplingParams, i: int) -> SamplingParams:
    """Completion ``i`` of an ``n > 1`` request: ``n=1``, and ``seed + i`` when seeded (as
    ``AsyncEngine`` does, so both modes sample the same completions)."""
    seed = None if params.seed is None else (params.seed + i) % (SEED_LIMIT + 1)
    return msgspec.structs.replace(params, n=1, seed=seed)


class EngineProcClient(EngineClient[ProcStream]):
    """``EngineClient`` over an engine core in its own process (module docstring)."""

    def __init__(self, config: EngineConfig | None = None, *, address: str | None = None) -> None:
        self.config = config or EngineConfig()
        self.address = address  # None: spawn a core and own it
        self.owner = address is None
        self.handle: CoreHandle | None = None
        self.core_pid: int | None = None
        self.on_core_death: list[Callable[[str], None]] = []
        self._tag = f"{os.getpid()}-{os.urandom(3).hex()}"  # core ids of this front end: TAG:N
        self._seq = itertools.count()
        self._ctx: Any = None
        self._sock: Any = None
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(CoreMessage)
        self._input: InputProcessor | None = None
        self._detok_tokenizer: Any = None
        self._model: ModelInfo | None = None
        self._routes: dict[str, tuple[ProcStream, Completion]] = {}  # core id -> its stream
        self._by_id: dict[str, ProcStream] = {}  # the request id given to the user -> its stream
        self._stats: dict[str, Any] = {}
        self._stats_waiters: list[tuple[float, asyncio.Future[dict[str, Any]]]] = []
        self._compiles: dict[int, asyncio.Future[str | None]] = {}  # CompileConstraint token -> answer
        self._checks: dict[int, asyncio.Future[str | None]] = {}  # CheckIntegrity token -> answer
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._dead: str | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> EngineProcClient:
        """Spawn the core (unless joining one), say hello, wait until it is ready, load the tokenizer."""
        if self._model is not None:
            return self
        import zmq
        import zmq.asyncio

        # one-line ConfigErrors for the model path (a hub id may download), max_model_len and the
        # model's files before the core process is spawned; a downloaded path is pinned here
        await asyncio.get_running_loop().run_in_executor(None, check_model, self.config)
        if self.owner:
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
        self.core_pid = ready.pid
        self._stats = ready.stats
        loop = asyncio.get_running_loop()
        self._input, self._detok_tokenizer = await loop.run_in_executor(None, self._build_input, ready)
        self._model = ready.model_info
        self._tasks = [
            asyncio.create_task(self._read(), name="deltaserve-proc-read"),
            asyncio.create_task(self._watch(), name="deltaserve-proc-watch"),
        ]
        log.info("engine_proc.ready", core_pid=self.core_pid, owner=self.owner, address=self.address)
        return self

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

    def _build_input(self, ready: Ready) -> tuple[InputProcessor, Any]:
        import copy

        from deltaserve.models.tokenizer import load_tokenizer

        tokenizer = with_chat_template(
            load_tokenizer(str(self.config.model.tokenizer or self.config.model.path)), self.config.model
        )
        defaults, source = sampling_defaults(self.config.model)
        ip = InputProcessor(
            tokenizer,
            max_model_len=ready.model_info.max_model_len,
            vocab_size=ready.model_info.vocab_size,
            salt_parts=ready.salt_parts,
            max_token_chars=ready.max_token_chars,
            sampling_defaults=defaults,
        )
        log_sampling_defaults(self.config.model, defaults, source)
        # detokenizing and tokenizing share no fast-tokenizer instance (their own mutable state)
        return ip, copy.deepcopy(tokenizer)

    async def shutdown(self) -> None:
        """End every open request (``abort``), stop the core if this client owns it (after it has
        aborted what is left and closed its engine), close the socket. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for stream in list(self._by_id.values()):
            ids = stream.end_all("abort", "engine shut down")
            if ids and not self.owner and self._dead is None:
                self._send(AbortRequests(ids))
        if self.owner and self._dead is None and self._sock is not None:
            self._send(Shutdown())
        await self._stop_core(kill=False)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        if self._sock is not None:
            # a live core gets the aborts queued above; nothing waits on a dead one
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

    @property
    def started(self) -> bool:
        return self._model is not None and not self._closed

    @property
    def input_processor(self) -> InputProcessor:
        if self._input is None:
            raise not_started("input_processor")
        return self._input

    @property
    def model_info(self) -> ModelInfo:
        if self._model is None:
            raise not_started("model_info")
        return self._model

    @property
    def tokenizer(self) -> Any:
        return self.input_processor.tokenizer

    def is_healthy(self) -> bool:
        """Started, not shut down, and the core process alive."""
        return self.started and self._dead is None

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
        """Assert the core's cache and scheduler accounting, checked in the core between two
        steps. Raises ``AssertionError`` (the core's message) when broken, ``EngineDeadError``
        if the core died."""
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

    # ------------------------------------------------------------------ API
    async def compile_constraint(self, constraint: Constraint) -> None:
        """``EngineClient.compile_constraint``: asks the core (its grammar workers compile; its
        loop goes on) and waits for the answer at most ``structured_outputs.compile_timeout_s``."""
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

    def submit(self, inp: RequestInput) -> ProcStream:
        """Validate and tokenize here (typed errors at the call); the request runs in the core."""
        self._check_alive()
        req = self.input_processor.process(inp)
        if req.request_id in self._by_id:
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in use")
        params: SamplingParams = req.sampling_params
        n = params.n
        self._check_capacity(n)
        tokenizer = self._detok_tokenizer
        completions, adds = [], []
        for i in range(n):
            p = child_params(params, i) if n > 1 else params
            core_id = f"{self._tag}:{next(self._seq)}"
            completions.append(
                Completion(
                    core_id, i, IncrementalDetokenizer(tokenizer, p.stop), p.min_tokens, req.num_prompt_tokens
                )
            )
            adds.append(
                AddRequest(core_id, req.prompt_token_ids, p, req.priority, req.cache_salt, req.arrival_time)
            )
        stream = ProcStream(self, req.request_id, completions, adds[1:])
        self._by_id[req.request_id] = stream
        for c in completions:
            self._routes[c.core_id] = (stream, c)
        self._send_adds(adds[:1])
        return stream

    def abort(self, request_id: str) -> asyncio.Future[bool]:
        """Abort a request at once (its stream ends with ``abort``); True if one was open."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        stream = self._by_id.get(request_id)
        if stream is None or stream.finished or not self.is_healthy():
            fut.set_result(False)
            return fut
        ids = stream.end_all("abort", None)
        self._abort_in_core(ids)
        fut.set_result(True)
        return fut

    # ------------------------------------------------------------------ plumbing
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self.started:
            raise EngineDeadError(
                "engine is not running (use `async with EngineProcClient(config) as engine`)"
            )

    def _check_capacity(self, n: int) -> None:
        """Admission control from the core's last stats plus this front end's unadmitted adds (the
        core ends a request that still overflows with an error)."""
        waiting = (
            int(self._stats.get("scheduler.waiting", 0)) + int(self._stats.get("grammar.parked", 0)) + n - 1
        )
        limit = self.config.scheduler.max_waiting
        if waiting >= limit:
            raise EngineOverloadedError(
                f"waiting queue is full ({waiting} >= scheduler.max_waiting = {limit}); retry later"
            )

    def _send(self, msg: Any) -> None:
        # DEALER with no high-water mark: the send queues at once, never blocks the event loop
        self._sock.send(self._enc.encode(msg))

    def _send_adds(self, adds: list[AddRequest]) -> None:
        if self._dead is None and not self._closed:
            for a in adds:
                self._send(a)

    def _abort_in_core(self, core_ids: list[str]) -> None:
        if core_ids and self._dead is None and self._sock is not None:
            self._send(AbortRequests(core_ids))

    def _forget(self, core_id: str) -> None:
        route = self._routes.pop(core_id, None)
        if route is not None:
            stream = route[0]
            if not stream.open() and self._by_id.get(stream.request_id) is stream:
                del self._by_id[stream.request_id]

    def _abandon(self, stream: ProcStream) -> None:
        stream.finished = True
        ids = stream.end_all("abort", None)
        self._abort_in_core(ids)

    async def _read(self) -> None:
        """Route the core's step outputs to their streams; a reader that fails is as bad as a dead
        core for this front end (no output would reach a stream again)."""
        try:
            await self._route_outputs()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to every open stream
            log.exception("engine_proc.read_failed")
            self._die(f"reading the engine core's outputs failed: {type(e).__name__}: {e}")

    async def _route_outputs(self) -> None:
        sock, dec, routes = self._sock, self._dec, self._routes
        while True:
            msg = dec.decode(await sock.recv())
            if isinstance(msg, ConstraintCompiled):
                fut = self._compiles.get(msg.token)
                if fut is not None and not fut.done():
                    fut.set_result(msg.error)
                continue
            if isinstance(msg, IntegrityChecked):
                fut = self._checks.get(msg.token)
                if fut is not None and not fut.done():
                    fut.set_result(msg.error)
                continue
            if not isinstance(msg, StepOutputs):
                continue
            if msg.stats is not None:
                self._stats = msg.stats
                if self._stats_waiters:
                    self._answer_stats(msg.stats)
            for d in msg.deltas:
                route = routes.get(d.request_id)
                if route is not None:
                    route[0].on_delta(route[1], d)

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
        """Poll the core's liveness; its death ends every open stream with an error."""
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
        log.error("engine_proc.core_died", error=message, open_requests=len(self._by_id))
        for stream in list(self._by_id.values()):
            stream.end_all("error", message)
        self._by_id.clear()
        self._routes.clear()
        for _, fut in self._stats_waiters:
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        self._stats_waiters = []
        for fut in [*self._compiles.values(), *self._checks.values()]:
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        for callback in self.on_core_death:
            try:
                callback(message)
            except Exception:  # noqa: BLE001 - one callback must not keep the others from running
                log.exception("engine_proc.death_callback_failed")
