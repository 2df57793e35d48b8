"""AsyncEngine: the public asyncio API and the one front end, an ``EngineClient``
(``engine/front/client.py``) over the engine core its core client reaches.

::

    async with AsyncEngine(EngineConfig.load("examples/serve.toml")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")

It is input processor -> core client -> output processor, in every placement:

* the ``InputProcessor`` validates and tokenizes (typed errors at the call), once;
* the core client (``engine/front/core_client.py``) carries requests to the core and its token
  deltas back: ``engine.core_process`` picks it (``in_process``: a core on a worker thread of
  this process; ``separate``: a core process; ``auto``: in process), or the caller passes one
  (``client=``: the cluster ingress passes its ``RayCoreClient``);
* the ``OutputProcessor`` (``engine/front/output_processor.py``) detokenizes, applies stop
  strings, fans out ``n`` and builds the ``RequestOutput`` deltas of each request's stream.

Contract:

* ``generate`` validates eagerly (typed errors are raised at the call, before iteration) and
  returns a ``RequestStream``: an async iterator of ``RequestOutput`` deltas whose last item has
  ``finished=True`` and a ``finish_reason`` (stop, length, abort, error).
* Leaving an ``async for`` early (``break``, an exception), cancelling the consuming task,
  or ``await stream.aclose()`` aborts the request; so does ``engine.abort(request_id)`` (its
  stream ends at once; the core drops the request between two steps).
* A request id belongs to the stream that created it: a stale stream of a finished request never
  aborts a newer request that reuses the id.
* Nothing is lost: if the core can no longer serve (its loop died, its process died, no replica
  is left), every open stream ends with ``error``, ``is_healthy()`` turns False, ``generate``
  raises ``EngineDeadError``, each ``on_core_death`` callback runs once, and ``shutdown()``
  still returns.
"""

from __future__ import annotations

import asyncio
import copy
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from deltaserve.engine.config import CoreProcess, EngineConfig
from deltaserve.engine.constraint import Constraint, trusted_decode
from deltaserve.engine.errors import EngineDeadError
from deltaserve.engine.front.client import EngineClient, ModelInfo, RequestInput, not_started
from deltaserve.engine.front.core_client import CoreClient
from deltaserve.engine.front.input_processor import InputProcessor
from deltaserve.engine.front.output_processor import OutputProcessor, RequestStream
from deltaserve.engine.messages import AddRequest, Ready, StepOutputs
from deltaserve.engine.model_files import log_sampling_defaults
from deltaserve.engine.sampling_params import SEED_LIMIT, SamplingParams
from deltaserve.logs import get_logger

if TYPE_CHECKING:
    from deltaserve.engine.core.engine_core import EngineCore

log = get_logger("deltaserve.engine")

__all__ = ["AsyncEngine", "RequestStream", "child_params", "install_uvloop", "placement_client"]


def child_params(params: SamplingParams, i: int) -> SamplingParams:
    """Completion ``i`` of an ``n > 1`` request: ``n=1``, and ``seed + i`` when seeded (built from
    validated parameters: not checked again)."""
    seed = None if params.seed is None else (params.seed + i) % (SEED_LIMIT + 1)
    with trusted_decode():
        return msgspec.structs.replace(params, n=1, seed=seed)


def install_uvloop() -> bool:
    """Use uvloop for new event loops when it is installed; True if it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def placement_client(
    config: EngineConfig, *, core: EngineCore | None = None, address: str | None = None
) -> CoreClient:
    """The core client ``engine.core_process`` asks for: ``in_process`` (and ``auto``, and any
    ``core`` passed in) a ``LocalCoreClient``; ``separate`` (or an ``address`` to join) a
    ``ProcCoreClient``."""
    if core is None and (address is not None or config.engine.core_process is CoreProcess.SEPARATE):
        from deltaserve.engine.front.proc_core import ProcCoreClient

        return ProcCoreClient(config, address=address)
    from deltaserve.engine.front.local_core import LocalCoreClient

    return LocalCoreClient(config, core=core)


class AsyncEngine(EngineClient[RequestStream]):
    """An asyncio engine: one model, continuous batching, a joint KV + GDN-state prefix cache.

    Use it as ``async with AsyncEngine(config) as engine`` (or ``await engine.start()`` and
    ``await engine.shutdown()``). ``generate`` submits a request; ``abort`` cancels one;
    ``stats`` returns counters; ``is_healthy`` and ``await check_integrity()`` let an
    application (or a test) watch the engine without touching its internals. ``core`` is the
    ``EngineCore`` when it runs in this process (else None); ``client`` the core client.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        core: EngineCore | None = None,
        client: CoreClient | None = None,
        address: str | None = None,
    ) -> None:
        self.config = config or (core.config if core else EngineConfig())
        self.client: CoreClient = client or placement_client(self.config, core=core, address=address)
        self.on_core_death: list[Callable[[str], None]] = []
        self._input: InputProcessor | None = None
        self._model: ModelInfo | None = None
        self._outputs: OutputProcessor | None = None
        self._closed = False
        self._dead: str | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> AsyncEngine:
        """Start (or join) the core, then build the input and output processors (idempotent)."""
        if self._model is not None:
            return self
        ready = await self.client.start(self)
        loop = asyncio.get_running_loop()
        self._input, detok = await loop.run_in_executor(None, self._processors, ready)
        self._outputs = OutputProcessor(detok, self.client.add_requests, self.client.abort_requests)
        self._model = ready.model_info
        return self

    def _processors(self, ready: Ready) -> tuple[InputProcessor, Any]:
        """The input processor (the client's, or one built from ``ready`` and the tokenizer
        loaded here) and the tokenizer the output processor detokenizes with."""
        ip = self.client.input_processor
        if ip is None:
            from deltaserve.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(str(self.config.model.tokenizer or self.config.model.path))
            if ready.chat_template is not None:  # the core's model.chat_template
                tokenizer.chat_template = ready.chat_template
            ip = InputProcessor(
                tokenizer,
                max_model_len=ready.model_info.max_model_len,
                vocab_size=ready.model_info.vocab_size,
                salt_parts=ready.salt_parts,
                max_token_chars=ready.max_token_chars,
                sampling_defaults=ready.sampling_defaults,
            )
        log_sampling_defaults(self.config.model, ready.sampling_defaults, ready.sampling_source)
        # tokenizing (any thread) and detokenizing share no fast-tokenizer instance: each mutates
        # its own state ("Already borrowed")
        return ip, copy.deepcopy(ip.tokenizer)

    async def shutdown(self) -> None:
        """End every open request (``abort``), then shut the core client down (an owned core
        aborts what is left and closes its engine). Never raises because the core died; safe
        to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._outputs is not None:
            ids = self._outputs.end_all("abort", "engine shut down")
            if self._dead is None and self._model is not None:
                self.client.abort_requests(ids)
            self._outputs.live = False
        await self.client.shutdown()

    @property
    def started(self) -> bool:
        """``start()`` has run and ``shutdown()`` has not been called."""
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

    @property
    def core(self) -> EngineCore | None:
        """The ``EngineCore`` when it runs in this process (``in_process``), else None."""
        return getattr(self.client, "core", None)

    @property
    def core_pid(self) -> int | None:
        """The pid of the process the core runs in (None before ``start``, or on a cluster)."""
        return self.client.core_pid

    def is_healthy(self) -> bool:
        """Started, not shut down, and the core serving."""
        return self.started and self._dead is None and self.client.is_healthy()

    # ------------------------------------------------------------------ API
    def submit(self, inp: RequestInput) -> RequestStream:
        """``generate``'s request (``EngineClient.generate`` documents the fields): validated and
        tokenized here, admitted, sent to the core (with ``n > 1``: completion 0 first)."""
        self._check_alive()
        assert self._outputs is not None
        req = self.input_processor.process(inp)
        params: SamplingParams = req.sampling_params
        n = params.n
        core_ids = self.client.core_ids(req.request_id, n)
        self._outputs.check_free(req.request_id, core_ids)
        self.client.check_capacity(n)
        adds = [
            AddRequest(
                cid,
                req.prompt_token_ids,
                child_params(params, i) if n > 1 else params,
                req.priority,
                req.cache_salt,
                req.arrival_time,
            )
            for i, cid in enumerate(core_ids)
        ]
        return self._outputs.open_stream(req.request_id, adds, req.num_prompt_tokens)

    def abort(self, request_id: str) -> asyncio.Future[bool]:
        """Abort a request at once (its stream ends with ``abort``); True if one was open."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        fut.set_result(self._outputs is not None and self.is_healthy() and self._outputs.abort(request_id))
        return fut

    async def compile_constraint(self, constraint: Constraint) -> None:
        """``EngineClient.compile_constraint``: where the core runs, off this event loop."""
        self._check_alive()
        await self.client.compile_constraint(constraint)

    def stats(self) -> dict[str, Any]:
        """The core's counters as last reported (``fetch_stats`` takes them now)."""
        return self.client.stats()

    async def fetch_stats(self) -> dict[str, Any]:
        """The core's stats taken now (after everything this front end sent before the call)."""
        self._check_alive()
        return await self.client.fetch_stats()

    async def check_integrity(self) -> None:
        """Assert the core's cache and scheduler accounting, between two steps. Raises
        ``AssertionError`` when broken, ``EngineDeadError`` if the core died."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        await self.client.check_integrity()

    # ------------------------------------------------------------------ from the core client
    def on_outputs(self, outputs: StepOutputs) -> None:
        """``OutputSink``: one step's deltas."""
        if self._outputs is not None:
            self._outputs.on_outputs(outputs)

    def on_dead(self, message: str) -> None:
        """``OutputSink``: the core can no longer serve: end every open stream with ``error``."""
        if self._dead is not None or self._closed:
            return
        self._dead = message
        log.error("engine.core_died", error=message, open_requests=self._open_requests(), pid=os.getpid())
        if self._outputs is not None:
            self._outputs.live = False
            self._outputs.end_all("error", message)
        for callback in self.on_core_death:
            try:
                callback(message)
            except Exception:  # noqa: BLE001 - one callback must not keep the others from running
                log.exception("engine.death_callback_failed")

    # ------------------------------------------------------------------ plumbing
    def _open_requests(self) -> int:
        return self._outputs.num_open if self._outputs is not None else 0

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self.started:
            raise EngineDeadError("engine is not running (use `async with AsyncEngine(config) as engine`)")
        if not self.client.is_healthy():
            raise EngineDeadError("the engine core is not serving")
