"""AsyncEngine: the public asyncio API, an ``EngineClient`` (``engine/front/client.py``) over one
``EngineCore`` in this process.

::

    async with AsyncEngine(EngineConfig.load("examples/serve.toml")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")

Contract:

* ``generate`` validates eagerly (typed errors are raised at the call, before iteration)
  and returns a ``RequestStream``: an async iterator of ``RequestOutput`` deltas whose last
  item has ``finished=True`` and a ``finish_reason`` (stop, length, abort, error).
* Leaving an ``async for`` early (``break``, an exception), cancelling the consuming task,
  or ``await stream.aclose()`` aborts the request; so does ``engine.abort(request_id)``
  (it acts at once; awaiting it waits until the abort is applied).
* A request id belongs to the stream that created it: a stale stream of a finished
  request never aborts a newer request that reuses the id.
* The engine loop runs each model step in one worker thread, so the event loop stays
  responsive; requests and aborts are applied between steps, never during one.
* Nothing is lost: if the loop dies for any reason (``BaseException`` included, or its
  task is cancelled) the engine is marked dead, every open stream ends with ``error``,
  ``generate`` raises ``EngineDeadError`` at once and ``shutdown()`` still returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.constraint import Constraint
from deltaserve.engine.core.core_loop import CoreLoop
from deltaserve.engine.core.engine_core import EngineCore
from deltaserve.engine.errors import EngineDeadError, InvalidRequestError
from deltaserve.engine.front.client import AbortingStream, EngineClient, ModelInfo, RequestInput, not_started
from deltaserve.engine.front.input_processor import InputProcessor
from deltaserve.engine.grammar import wait_compiled
from deltaserve.engine.model_files import log_sampling_defaults
from deltaserve.engine.outputs import RequestOutput
from deltaserve.engine.sampling_params import SEED_LIMIT, SamplingParams
from deltaserve.logs import get_logger
from deltaserve.scheduler.request import Request

log = get_logger("deltaserve.engine")


def _child_params(params: SamplingParams, i: int) -> SamplingParams:
    """Completion ``i`` of an ``n > 1`` request: ``n=1``, and ``seed + i`` when seeded."""
    seed = None if params.seed is None else (params.seed + i) % (SEED_LIMIT + 1)
    return msgspec.structs.replace(params, n=1, seed=seed)


def install_uvloop() -> bool:
    """Use uvloop for new event loops when it is installed; True if it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


class RequestStream(AbortingStream):
    """The handle ``generate`` returns: async-iterate it for one request's ``RequestOutput`` deltas.

    ``async for out in stream`` iterates through a fresh inner generator: when the loop is
    left early that generator is dropped and finalised, which aborts the request even while
    the application still holds ``stream``. ``await stream.__anext__()`` reads one delta;
    ``await stream.aclose()`` aborts an unfinished request. ``request_id`` names it.
    """

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    async def _next(self) -> RequestOutput:
        out = await self._queue.get()
        if out.finished:
            self.finished = True
        return out

    def _abandon(self) -> None:
        self._engine._abandon(self)

    def _put(self, out: RequestOutput) -> None:
        self._queue.put_nowait(out)


class ForkedStream(RequestStream):
    """The stream of a request with ``SamplingParams.n > 1``: its ``n`` completions, each an
    engine request of its own (ids ``rid``, ``rid.1``, ...), merged under ``request_id``.

    Every delta carries ``index``; a completion's last delta has ``finished=True`` and its
    ``finish_reason``; iteration ends after all ``n`` have finished. The first completion runs
    alone until its first token: its prompt is then in the prefix cache, and the others are
    submitted and start from there (one prefill, ``n`` decodes).
    """

    def __init__(
        self, engine: AsyncEngine, request_id: str, child_ids: list[str], later: list[Request]
    ) -> None:
        super().__init__(engine, request_id)
        self.child_ids = child_ids
        self._index = {cid: i for i, cid in enumerate(child_ids)}
        self._open = set(child_ids)  # engine requests that have not delivered their last output
        self.later: list[Request] | None = later  # children 1..n-1 until they are submitted
        self._done = 0

    def _put(self, out: RequestOutput) -> None:
        rid = out.request_id
        if rid not in self._open:
            return
        if self.later is not None and self._index[rid] == 0:
            self._engine._fork(self)  # the first completion's prompt is computed (or it ended)
        out.index = self._index[rid]
        out.request_id = self.request_id
        if out.finished:
            self._open.discard(rid)
            if not self._open:
                self._engine._forks.pop(self.request_id, None)
        self._queue.put_nowait(out)

    async def _next(self) -> RequestOutput:
        out = await self._queue.get()
        if out.finished:
            self._done += 1
            if self._done == len(self.child_ids):
                self.finished = True
        return out

    def open_ids(self) -> list[str]:
        return [cid for cid in self.child_ids if cid in self._open]


class AsyncEngine(EngineClient[RequestStream]):
    """An asyncio engine: one model, continuous batching, a joint KV + GDN-state prefix cache.

    Use it as ``async with AsyncEngine(config) as engine`` (or ``await engine.start()`` and
    ``await engine.shutdown()``). ``generate`` submits a request; ``abort`` cancels one;
    ``stats`` returns counters; ``is_healthy`` and ``await check_integrity()`` let an
    application (or a test) watch the engine without touching its internals.
    """

    def __init__(self, config: EngineConfig | None = None, *, core: EngineCore | None = None) -> None:
        self.config = config or (core.config if core else EngineConfig())
        self.core: EngineCore | None = core
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-step")
        self._streams: dict[str, RequestStream] = {}  # request id -> the stream that owns it
        self._forks: dict[str, ForkedStream] = {}  # n > 1: the request id given to the user -> its stream
        self._pending_add: list[Request] = []
        # (request id, the stream asking, or None for `abort(id)`, a future resolved when applied)
        self._pending_abort: list[tuple[str, RequestStream | None, asyncio.Future[bool] | None]] = []
        self._pending_checks: list[asyncio.Future[None]] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._step: concurrent.futures.Future[list[RequestOutput]] | None = None
        self._closed = False
        self._in_step = False  # a step runs in the worker: the scheduler/cache are not ours to read
        self._last_stats: dict[str, Any] = {}
        self._dead: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> AsyncEngine:
        """Load the model (in the worker thread, off the event loop) and start the engine loop."""
        if self._task is not None:
            return self
        loop = asyncio.get_running_loop()
        if self.core is None:
            self.core = await loop.run_in_executor(self._executor, EngineCore, self.config)
        log_sampling_defaults(self.core.config.model, *self.core.sampling_defaults)
        self._wakeup = asyncio.Event()
        # a parked request's grammar compiled (on a grammar worker): step again now
        self.core.on_grammar_ready = lambda: loop.call_soon_threadsafe(self._wake)
        self._task = asyncio.create_task(self._run(), name="deltaserve-engine-loop")
        self._task.add_done_callback(self._on_loop_done)
        return self

    async def shutdown(self) -> None:
        """Stop the loop, abort every open request (their streams end with ``abort``), free the
        worker thread. Never raises because the loop died; safe to call twice."""
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            await asyncio.wait([self._task])  # its failure is reported by the streams, not here
        if self._step is not None and not self._step.done():
            # a step cut off by a dying loop still runs in the worker: let it finish first
            await asyncio.wait([asyncio.wrap_future(self._step)])
        if self.core is not None:
            try:
                for out in self._drain_all_aborted():
                    self._route(out)
            except Exception:
                if self._dead is None:
                    raise
                # the loop died (perhaps of a corrupt cache): its requests were already ended
                log.exception("engine.shutdown_cleanup_failed")
        self._resolve_pending(EngineDeadError("engine shut down"))
        if self.core is not None:
            # the forward worker of async scheduling (abort_all above finished the step in flight;
            # after a dead loop, whatever is left is not worth another error)
            # (in the worker: closing a disk tier writes what it lacks and flushes the store)
            with contextlib.suppress(Exception) if self._dead is not None else contextlib.nullcontext():
                await asyncio.get_running_loop().run_in_executor(self._executor, self.core.close)
        self._executor.shutdown(wait=True)

    @property
    def started(self) -> bool:
        """``start()`` has run and ``shutdown()`` has not been called."""
        return self._task is not None and not self._closed

    @property
    def input_processor(self) -> InputProcessor:
        if self.core is None:
            raise not_started("input_processor")
        return self.core.input_processor

    @property
    def model_info(self) -> ModelInfo:
        if self.core is None:
            raise not_started("model_info")
        return self.core.model_info

    @property
    def tokenizer(self) -> Any:
        return self.input_processor.tokenizer

    def is_healthy(self) -> bool:
        """True while the engine loop runs and can serve requests."""
        return self._task is not None and not self._task.done() and self._dead is None and not self._closed

    # ------------------------------------------------------------------ API
    async def compile_constraint(self, constraint: Constraint) -> None:
        """``EngineClient.compile_constraint``: on the core's grammar workers, off the event loop."""
        self._check_alive()
        assert self.core is not None
        grammars = self.core.grammars
        await wait_compiled(grammars.compile_async(constraint), grammars.timeout_s)

    def submit(self, inp: RequestInput) -> RequestStream:
        """``generate``'s request (``EngineClient.generate`` documents the fields): validated here,
        queued for the loop. With ``SamplingParams.n > 1`` the stream is a ``ForkedStream``."""
        self._check_alive()
        assert self.core is not None
        req = self.core.process(inp)
        n = req.sampling_params.n
        child_ids = [req.request_id] + [f"{req.request_id}.{i}" for i in range(1, n)]
        self._check_ids_free(req.request_id, child_ids)
        # Admission control happens here, at once, not when the loop gets to it.
        self.core.check_capacity(pending=len(self._pending_add) + n - 1)
        stream = RequestStream(self, req.request_id) if n == 1 else self._forked_stream(req, child_ids)
        for cid in child_ids:
            self._streams[cid] = stream
        self._pending_add.append(req)
        self._wake()
        return stream

    def _check_ids_free(self, request_id: str, child_ids: list[str]) -> None:
        """Every engine request id of a new request is free (``process`` checked the first
        against the scheduler's requests already)."""
        assert self.core is not None
        for cid in child_ids:
            if (
                cid in self._streams
                or cid in self._forks
                or (cid != request_id and self.core.has_request(cid))
            ):
                raise InvalidRequestError(f"request_id {cid!r} is already in use")

    def _forked_stream(self, req: Request, child_ids: list[str]) -> ForkedStream:
        """The stream of an ``n > 1`` request: ``req`` becomes completion 0; the others wait in
        the stream until completion 0 has its first token."""
        params: SamplingParams = req.sampling_params
        req.sampling_params = _child_params(params, 0)
        later = [
            Request(
                request_id=cid,
                prompt_token_ids=list(req.prompt_token_ids),
                sampling_params=_child_params(params, i),
                priority=req.priority,
                cache_salt=req.cache_salt,
            )
            for i, cid in enumerate(child_ids[1:], 1)
        ]
        stream = ForkedStream(self, req.request_id, child_ids, later)
        self._forks[req.request_id] = stream
        return stream

    def abort(self, request_id: str) -> asyncio.Future[bool]:
        """Abort a request; its stream ends with ``finish_reason="abort"``.

        Takes effect whether or not the result is awaited; awaiting it waits until the abort
        is applied (between steps) and gives True if a request was aborted.
        """
        fork = self._forks.get(request_id)
        if fork is not None and self.is_healthy():
            return self._abort_fork(fork)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if request_id not in self._streams or not self.is_healthy():
            fut.set_result(False)
            return fut
        self._pending_abort.append((request_id, None, fut))
        self._wake()
        return fut

    @property
    def in_step(self) -> bool:
        """A step runs in the worker thread: the scheduler and cache may change under a reader."""
        return self._in_step

    def stats(self) -> dict[str, Any]:
        """Engine counters; while a step runs, the snapshot taken after the previous one."""
        if self.core is None:
            return {}
        if self._in_step:
            return dict(self._last_stats)
        return self.core.stats()

    async def check_integrity(self) -> None:
        """Assert the cache and scheduler accounting (every block and slot in exactly one state),
        between two steps. Raises ``AssertionError`` when broken, ``EngineDeadError`` if the loop died."""
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

    # ------------------------------------------------------------------ plumbing
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._task is not None and self._task.done() and not self._closed:
            raise EngineDeadError("engine loop has stopped")
        if self.core is None or self._task is None or self._closed:
            raise EngineDeadError("engine is not running (use `async with AsyncEngine(config) as engine`)")

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _abort_fork(self, fork: ForkedStream) -> asyncio.Future[bool]:
        """Abort every completion of an ``n > 1`` request; True if any was aborted."""
        loop = asyncio.get_running_loop()
        assert self.core is not None
        unsubmitted, fork.later = fork.later or [], None
        for r in unsubmitted:  # never reached the engine: they end here
            self._route(self.core._final_output(r, "abort", [], ""))
        futs = []
        for cid in fork.open_ids():
            fut: asyncio.Future[bool] = loop.create_future()
            self._pending_abort.append((cid, None, fut))
            futs.append(fut)
        self._wake()
        result: asyncio.Future[bool] = loop.create_future()
        if not futs:
            result.set_result(bool(unsubmitted))
            return result

        def done(g: asyncio.Future[list[bool]]) -> None:
            if not result.done():
                result.set_result(bool(unsubmitted) or (not g.cancelled() and any(g.result())))

        asyncio.gather(*futs).add_done_callback(done)
        return result

    def _fork(self, fork: ForkedStream) -> None:
        """Submit the other completions of an ``n > 1`` request (its first one has a token)."""
        later, fork.later = fork.later or [], None
        if self._closed or self._dead is not None:
            return  # shutdown / _die end them through self._streams
        self._pending_add.extend(later)
        self._wake()

    def _abandon(self, stream: RequestStream) -> None:
        """A stream was left before its request finished: abort the request it owns."""
        if isinstance(stream, ForkedStream):
            if self._forks.get(stream.request_id) is stream:
                for r in stream.later or []:  # never submitted: forget them
                    self._streams.pop(r.request_id, None)
                stream.later = None
                if self.is_healthy():
                    for cid in stream.open_ids():
                        if self._streams.get(cid) is stream:
                            self._pending_abort.append((cid, stream, None))
                    self._wake()
            return
        if self._streams.get(stream.request_id) is stream and self.is_healthy():
            self._pending_abort.append((stream.request_id, stream, None))
            self._wake()

    def _route(self, out: RequestOutput) -> None:
        rid = out.request_id  # a ForkedStream renames the output to the request the user made
        stream = self._streams.get(rid)
        if stream is None:
            return
        stream._put(out)
        if out.finished:
            del self._streams[rid]

    def _apply_pending(self) -> None:
        assert self.core is not None
        adds, self._pending_add = self._pending_add, []
        for req in adds:
            try:
                self.core.add_request(req)
            except Exception as e:  # e.g. overload raced past the eager check
                self._route(self.core._final_output(req, "error", [], "", error=f"{type(e).__name__}: {e}"))
        aborts, self._pending_abort = self._pending_abort, []
        for rid, stream, fut in aborts:
            # the id may have been finished and reused since: only its owner's abort applies
            owner = self._streams.get(rid)
            out = None
            if owner is not None and (stream is None or owner is stream):
                out = self.core.abort_request(rid)
                if out is not None:
                    self._route(out)
            if fut is not None and not fut.done():
                fut.set_result(out is not None)
        checks, self._pending_checks = self._pending_checks, []
        for fut in checks:
            try:
                self.core.check_integrity()
            except BaseException as e:  # noqa: BLE001 - reported to the caller, who asked
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(None)

    def _drain_all_aborted(self) -> list[RequestOutput]:
        assert self.core is not None
        outs = [
            self.core._final_output(r, "abort", [], "", error="engine shut down") for r in self._pending_add
        ]
        self._pending_add = []
        for fork in list(self._forks.values()):  # n > 1 completions not submitted yet
            outs += [
                self.core._final_output(r, "abort", [], "", error="engine shut down")
                for r in fork.later or []
            ]
            fork.later = None
        return outs + self.core.abort_all()

    async def _run(self) -> None:
        assert self.core is not None and self._wakeup is not None
        loop = CoreLoop(self.core, _LocalPort(self), self.config.logging.stats_interval_s)
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
        """The loop stopped for good: mark the engine dead and end every open stream."""
        if self._dead is not None:
            return
        if self._closed and isinstance(exc, asyncio.CancelledError):
            return  # shutdown racing a cancel: streams are ended by shutdown
        self._dead = exc
        log.error("engine.loop_died", error=repr(exc), open_requests=len(self._streams), exc_info=exc)
        message = f"engine loop died: {exc!r}"
        for rid, stream in list(self._streams.items()):
            stream._put(
                RequestOutput(
                    request_id=rid, token_ids=[], text="", finished=True, finish_reason="error", error=message
                )
            )
        self._streams.clear()
        self._forks.clear()
        self._resolve_pending(EngineDeadError(message))

    def _resolve_pending(self, error: Exception) -> None:
        for _, _, fut in self._pending_abort:
            if fut is not None and not fut.done():
                fut.set_result(False)
        self._pending_abort = []
        for fut in self._pending_checks:
            if not fut.done():
                fut.set_exception(error)
        self._pending_checks = []


class _LocalPort:
    """The core loop's port in this process (``engine/core/core_loop.py``): inputs are the engine's
    pending adds, aborts and integrity checks, applied on the event loop between steps; the
    step runs on the engine's worker thread; outputs go to the streams."""

    idle_period_s: float | None = None  # nothing to watch: an idle engine sleeps until woken

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def stopped(self) -> bool:
        return self.engine._closed

    def take(self) -> None:
        self.engine._apply_pending()

    async def wait(self, timeout: float | None) -> None:
        e = self.engine
        assert e._wakeup is not None
        # cleared before the check: a wake-up after it is kept, one before it is applied now
        e._wakeup.clear()
        if e._closed or e._pending_add or e._pending_abort or e._pending_checks:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(e._wakeup.wait(), timeout=timeout)

    async def step(self) -> list[RequestOutput]:
        e = self.engine
        assert e.core is not None
        e._in_step = True
        try:
            e._step = e._executor.submit(e.core.step)
            outputs = await asyncio.wrap_future(e._step)
        finally:
            e._in_step = False
        e._last_stats = e.core.stats()
        return outputs

    def emit(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.engine._route(out)

    def went_idle(self) -> None:
        pass  # the streams have every output already; stats() reads the core directly
