"""AsyncEngine: the public asyncio API.

::

    async with AsyncEngine(EngineConfig.load("serve.toml")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")

``generate`` validates eagerly (typed errors are raised at the call, before iteration)
and returns an async iterator of ``RequestOutput`` deltas; leaving the iteration early or
cancelling the consuming task aborts the request. The engine loop runs each model step
in a single worker thread, so the event loop stays responsive while a step runs; new
requests and aborts are applied between steps, never concurrently with one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.core import EngineCore, Prompt
from deltaserve.engine.errors import EngineDeadError, InvalidRequestError
from deltaserve.engine.outputs import RequestOutput
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.logs import get_logger
from deltaserve.scheduler.request import Request

log = get_logger("deltaserve.engine")


def install_uvloop() -> bool:
    """Use uvloop for new event loops when it is installed; True if it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, *, core: EngineCore | None = None) -> None:
        self.config = config or (core.config if core else EngineConfig())
        self.core: EngineCore | None = core
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-step")
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._pending_add: list[Request] = []
        self._pending_abort: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._in_step = False  # a step runs in the worker: the scheduler/cache are not ours to read
        self._last_stats: dict[str, Any] = {}
        self._dead: BaseException | None = None
        self._last_log = time.monotonic()
        self._window = {"tokens": 0, "steps": 0, "t0": time.monotonic()}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> AsyncEngine:
        if self._task is not None:
            return self
        loop = asyncio.get_running_loop()
        if self.core is None:
            # Loading builds/reads weights: keep the event loop free meanwhile.
            self.core = await loop.run_in_executor(self._executor, EngineCore, self.config)
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="deltaserve-engine-loop")
        return self

    async def shutdown(self) -> None:
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.core is not None:
            for out in self._drain_all_aborted():
                self._route(out)
        self._executor.shutdown(wait=True)

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def tokenizer(self) -> Any:
        assert self.core is not None, "engine not started"
        return self.core.tokenizer

    # ------------------------------------------------------------------ API
    def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; iterate the result for its ``RequestOutput`` deltas."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self.core is None or self._task is None or self._closed:
            raise EngineDeadError("engine is not running (use `async with AsyncEngine(config) as engine`)")
        req = self.core.make_request(
            prompt, sampling_params, request_id=request_id, priority=priority, cache_salt=cache_salt
        )
        if req.request_id in self._queues:
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in use")
        # Admission control happens here, at once, not when the loop gets to it.
        self.core.check_capacity(pending=len(self._pending_add))
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[req.request_id] = queue
        self._pending_add.append(req)
        assert self._wakeup is not None
        self._wakeup.set()
        return self._stream(req.request_id, queue)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._request_abort(request_id)

    def _request_abort(self, request_id: str) -> None:
        if request_id in self._queues:
            self._pending_abort.append(request_id)
            if self._wakeup is not None:
                self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its iterator ends with ``finish_reason="abort"``."""
        self._request_abort(request_id)

    def stats(self) -> dict[str, Any]:
        """Engine counters; while a step runs, the snapshot taken after the previous one."""
        if self.core is None:
            return {}
        if self._in_step:
            return dict(self._last_stats)
        return self.core.stats()

    # ------------------------------------------------------------------ loop
    def _apply_pending(self) -> None:
        assert self.core is not None
        adds, self._pending_add = self._pending_add, []
        for req in adds:
            try:
                self.core.add_request(req)
            except Exception as e:  # overload raced past the eager check
                self._route(self.core._final_output(req, "error", [], "", error=str(e)))
        aborts, self._pending_abort = self._pending_abort, []
        for rid in aborts:
            out = self.core.abort_request(rid)
            if out is not None:
                self._route(out)

    def _route(self, out: RequestOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is None:
            return
        queue.put_nowait(out)
        if out.finished:
            del self._queues[out.request_id]

    def _drain_all_aborted(self) -> list[RequestOutput]:
        assert self.core is not None
        outs: list[RequestOutput] = []
        for req in self._pending_add:
            outs.append(self.core._final_output(req, "abort", [], "", error="engine shut down"))
        self._pending_add = []
        return outs + self.core.abort_all()

    async def _run(self) -> None:
        assert self.core is not None and self._wakeup is not None
        core = self.core
        loop = asyncio.get_running_loop()
        try:
            while not self._closed:
                self._apply_pending()
                if not core.has_work():
                    self._wakeup.clear()
                    if self._pending_add or self._pending_abort:
                        continue
                    # idle: wake for work, or for the periodic stats line (0 = none)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(
                            self._wakeup.wait(), timeout=self.config.logging.stats_interval_s or None
                        )
                    continue
                self._in_step = True
                try:
                    outputs = await loop.run_in_executor(self._executor, core.step)
                finally:
                    self._in_step = False
                self._last_stats = core.stats()
                for out in outputs:
                    self._route(out)
                self._window["steps"] += 1
                self._window["tokens"] += len(outputs)
                self._maybe_log()
                await asyncio.sleep(0)  # let producers and consumers run between steps
        except Exception as e:
            self._dead = e
            log.exception("engine.loop_died")
            for rid, queue in list(self._queues.items()):
                queue.put_nowait(
                    RequestOutput(
                        request_id=rid,
                        token_ids=[],
                        text="",
                        finished=True,
                        finish_reason="error",
                        error=f"engine loop died: {e!r}",
                    )
                )
            self._queues.clear()

    def _maybe_log(self) -> None:
        interval = self.config.logging.stats_interval_s
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval:
            return
        assert self.core is not None
        dt = now - self._window["t0"]
        s = self._last_stats  # taken right after this step
        log.info(
            "engine.stats",
            gen_tok_s=round(self._window["tokens"] / dt, 1) if dt > 0 else 0.0,
            steps_s=round(self._window["steps"] / dt, 2) if dt > 0 else 0.0,
            running=s["scheduler.running"],
            waiting=s["scheduler.waiting"],
            kv_usage=round(s["kv.usage"], 3),
            hit_rate=round(s["prefix_cache.hit_rate"], 3),
            checkpoints=s["checkpoints.attached"],
            preemptions=s["scheduler.preemptions"],
        )
        self._last_log = now
        self._window = {"tokens": 0, "steps": 0, "t0": now}
