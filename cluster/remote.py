"""The ingress side: an ``EngineClient`` over the engine deployment's ``DeploymentHandle``.

``RemoteEngine`` implements ``deltaserve.engine.front.client.EngineClient``, so
``deltaserve.server.app.create_app(RemoteEngine(...))`` serves every endpoint of the
single-engine server (chat, completions, streaming, ``n``, logprobs, tools, tokenize, errors)
unchanged, with each request's work done on a replica chosen by the router.

* ``start()`` asks a replica to ``describe()`` itself, loads the tokenizer locally and builds
  an ``InputProcessor`` from them: the engine's own validation and tokenization (chat
  templates included) without a model. So bad input is refused at the ingress with the same
  typed errors (400 before any stream starts), the prompt is tokenized once, and its route
  keys are hashed once (``route_hint``), with the exact salt the engine uses. Request ids are
  not checked for uniqueness here: the replica does.
* ``generate()`` returns a ``RemoteStream``: the replica's ``RequestOutput`` deltas.
  Replica faults: a replica that dies (or is unreachable) before the request produced any
  output is retried on another one (``max_retries``; the router has forgotten the dead one);
  after output was produced the stream ends at once with ``finish_reason="error"`` and an
  ``error`` naming the replica (the server turns that into an in-band error frame or a 500).
  Closing the stream, or ``abort(request_id)``, cancels the remote call, which aborts the
  request on the replica.
* ``stats()`` sums the numeric engine stats the replicas sent with their last routing-stats
  reports (``/metrics`` of the ingress: the cluster's counters, at most one report period old).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from typing import Any

from deltaserve.cluster.affinity import RouteHint, route_keys
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.errors import DeltaServeError, EngineDeadError
from deltaserve.engine.front.client import AbortingStream, EngineClient, ModelInfo, RequestInput, not_started
from deltaserve.engine.front.input_processor import InputProcessor
from deltaserve.engine.outputs import RequestOutput
from deltaserve.logs import get_logger
from deltaserve.models.tokenizer import load_tokenizer
from deltaserve.scheduler.request import Request

log = get_logger("deltaserve.cluster")

#: most recent request id -> replica records kept for GET /cluster/routes
MAX_ROUTES = 4096


def route_hint(req: Request, *, block_size: int, unit: int) -> RouteHint:
    """The router's hint for ``req``: its joint-prefix keys at unit boundaries (the engine's
    chained block hashes, with the request's salt)."""
    keys = route_keys(req.prompt_token_ids, block_size=block_size, unit=unit, salt=req.cache_salt)
    return RouteHint(tuple(keys), unit, req.num_prompt_tokens)


def _unwrap(exc: BaseException) -> BaseException:
    """The user exception inside a Ray task error (its ``cause``), else the error itself."""
    try:
        from ray.exceptions import RayTaskError
    except ImportError:  # pragma: no cover - ray is there whenever this runs
        return exc
    if isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None:
        return exc.cause
    return exc


def is_replica_failure(exc: BaseException) -> bool:
    """The replica (or its node) died or cannot be reached: not the request's fault."""
    try:
        from ray import exceptions as rx
    except ImportError:  # pragma: no cover
        return False
    kinds: list[type] = [rx.RayActorError, rx.WorkerCrashedError, rx.NodeDiedError]
    for name in ("ActorDiedError", "ActorUnavailableError", "OutOfMemoryError", "ObjectLostError"):
        k = getattr(rx, name, None)
        if isinstance(k, type):
            kinds.append(k)
    if isinstance(exc, tuple(kinds)):
        return True
    cause = _unwrap(exc)
    return cause is not exc and isinstance(cause, tuple(kinds))


class RemoteStream(AbortingStream):
    """One request's deltas from a replica (``AsyncEngine``'s ``RequestStream`` contract:
    async-iterate it; the last delta of each of the ``n`` completions has ``finished=True``;
    leaving early or ``aclose()`` aborts the request)."""

    def __init__(self, engine: RemoteEngine, req: Request, hint: RouteHint, cache_salt: str | None) -> None:
        self.request_id = req.request_id
        self.finished = False
        self.replica: str | None = None
        self.attempts = 0
        self._engine = engine
        self._req = req
        self._hint = hint
        self._cache_salt = cache_salt  # the tenant's string (req.cache_salt is the hashed salt)
        self._gen: Any = None
        self._pending: deque[RequestOutput] = deque()
        self._open = set(range(req.sampling_params.n))
        self._received = False  # the replica sent output: a failure is no longer retried
        self._aborted = False  # RemoteEngine.abort: the abort outputs are queued, the call is cancelled

    # ------------------------------------------------------------------ iteration
    async def _next(self) -> RequestOutput:
        while not self._pending:
            await self._fill()
        out = self._pending.popleft()
        if out.finished:
            self._open.discard(out.index)
            if not self._open:
                self.finished = True
                self._engine._closed_stream(self)
        return out

    # ------------------------------------------------------------------ the remote call
    def _start(self) -> None:
        self.attempts += 1
        req = self._req
        self._gen = self._engine.handle.options(stream=True).generate.remote(
            list(req.prompt_token_ids),
            req.sampling_params,
            request_id=req.request_id,
            priority=req.priority,
            cache_salt=self._cache_salt,
            route=self._hint,
        )

    def _abandon(self) -> None:
        self.finished = True
        gen, self._gen = self._gen, None
        if gen is not None:
            with contextlib.suppress(Exception):  # already finished or gone
                gen.cancel()
        self._engine._closed_stream(self)

    def abort(self) -> None:
        """End every open completion with ``abort`` (after the deltas already received) and
        cancel the remote call, which aborts the request on its replica."""
        if self.finished or self._aborted:
            return
        self._aborted = True
        gen, self._gen = self._gen, None
        if gen is not None:
            with contextlib.suppress(Exception):  # already finished or gone
                gen.cancel()
        self._end_open("abort", None)

    async def _fill(self) -> None:
        if self._gen is None:
            self._start()
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            self._gen = None
            if not self._aborted:
                self._fail(f"replica {self.replica} ended the stream before the request finished")
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - sorted below
            if not self._aborted:  # (an aborted call may fail for being cancelled)
                self._on_error(e)
            return
        if self._aborted:
            return  # arrived after the abort outputs: dropped
        if isinstance(item, dict) and "accepted" in item:
            self.replica = str(item["accepted"])
            self._engine._record_route(self.request_id, self.replica, self.attempts)
            return
        self._received = True
        for out in item:
            out.request_id = self.request_id
            self._pending.append(out)

    def _on_error(self, e: Exception) -> None:
        gen, self._gen = self._gen, None
        engine = self._engine
        if is_replica_failure(e) or isinstance(_unwrap(e), EngineDeadError):
            engine.counters["replica_failures"] += 1
            if gen is not None:
                with contextlib.suppress(Exception):
                    gen.cancel()
            if not self._received and self.attempts <= engine.max_retries:
                engine.counters["retries"] += 1
                log.warning(
                    "cluster.retry", request_id=self.request_id, replica=self.replica, error=repr(e)[:300]
                )
                self.replica = None
                return  # the next _fill starts a new call; the router avoids the dead replica
            self._fail(f"replica {self.replica or '?'} failed: {type(_unwrap(e)).__name__}: {_unwrap(e)}")
            return
        cause = _unwrap(e)
        if not self._received and self.replica is None and isinstance(cause, DeltaServeError):
            self.finished = True
            self._engine._closed_stream(self)
            raise cause  # rejected by the replica (e.g. request id in use, overloaded): typed
        self._fail(f"replica {self.replica or '?'}: {type(cause).__name__}: {cause}")

    def _fail(self, message: str) -> None:
        """End every open completion with an error (nothing is lost silently)."""
        log.error("cluster.request_failed", request_id=self.request_id, error=message)
        self._engine.counters["failed"] += 1
        self._end_open("error", message)

    def _end_open(self, reason: str, error: str | None) -> None:
        """Queue a last output for every completion that has not had one queued."""
        ended = {out.index for out in self._pending if out.finished}
        for i in sorted(self._open - ended):
            self._pending.append(
                RequestOutput(
                    request_id=self.request_id,
                    token_ids=[],
                    text="",
                    finished=True,
                    finish_reason=reason,
                    error=error,
                    index=i,
                    num_prompt_tokens=self._req.num_prompt_tokens,
                )
            )


class RemoteEngine(EngineClient[RemoteStream]):
    """``EngineClient`` over the engine deployment (module docstring)."""

    def __init__(
        self,
        handle: Any,
        config: EngineConfig,
        *,
        app_name: str | None = None,
        deployment_name: str | None = None,
        max_retries: int = 2,
    ) -> None:
        self.handle = handle
        self.config = config
        self.app_name = app_name
        self.deployment_name = deployment_name or getattr(handle, "deployment_name", None)
        self.max_retries = max_retries
        self.info: dict[str, Any] = {}  # a replica's describe()
        self._input: InputProcessor | None = None
        self._model: ModelInfo | None = None
        self._closed = False
        self._streams: set[RemoteStream] = set()
        self.routes: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.counters = {"requests": 0, "retries": 0, "replica_failures": 0, "failed": 0}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> RemoteEngine:
        """Ask a replica to describe itself and load the tokenizer here (idempotent)."""
        if self._input is not None:
            return self
        info = dict(await self.handle.describe.remote())
        loop = asyncio.get_running_loop()
        tokenizer = await loop.run_in_executor(None, load_tokenizer, str(self.config.model.path))
        self.prepare(info, tokenizer)
        log.info("cluster.ingress_ready", model=self.model_info.name, unit=self.model_info.checkpoint_unit)
        return self

    def prepare(self, info: dict[str, Any], tokenizer: Any) -> None:
        """The input processor and model info from a replica's ``describe()`` and the tokenizer."""
        self.info = dict(info)
        self._model = ModelInfo(**{f: info[f] for f in ModelInfo.__struct_fields__ if f in info})
        if info.get("chat_template"):  # the replica's model.chat_template
            tokenizer.chat_template = info["chat_template"]
        self._input = InputProcessor(
            tokenizer,
            max_model_len=self._model.max_model_len,
            vocab_size=self._model.vocab_size,
            salt_parts=info["salt_parts"],
            max_token_chars=info["max_token_chars"],
            sampling_defaults=info.get("sampling_defaults"),
        )

    async def shutdown(self) -> None:
        self._closed = True
        for s in list(self._streams):
            await s.aclose()

    @property
    def started(self) -> bool:
        return self._input is not None and not self._closed

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
        """Started, not shut down, and (once a router exists) at least one live replica."""
        if not self.started:
            return False
        from deltaserve.cluster.registry import routers

        rs = routers(self.app_name, self.deployment_name)
        return not rs or any(r.num_live_replicas() for r in rs)

    # ------------------------------------------------------------------ API
    def submit(self, inp: RequestInput) -> RemoteStream:
        """Validate and tokenize here (typed errors, as ``AsyncEngine.generate``); the work runs
        on the replica the router picks."""
        if not self.is_healthy():
            raise EngineDeadError("the cluster ingress is not running")
        req = self.input_processor.process(inp)
        hint = route_hint(req, block_size=self.model_info.block_size, unit=self.model_info.checkpoint_unit)
        stream = RemoteStream(self, req, hint, inp.cache_salt)
        self._streams.add(stream)
        self.counters["requests"] += 1
        return stream

    def abort(self, request_id: str) -> asyncio.Future[bool]:
        """Abort the open request ``request_id`` (its stream ends with ``abort``); True if there was one."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        streams = [s for s in self._streams if s.request_id == request_id and not s.finished]
        for s in streams:
            s.abort()
        fut.set_result(bool(streams))
        return fut

    def stats(self) -> dict[str, Any]:
        """The replicas' engine stats, summed (ratios recomputed from the sums)."""
        from deltaserve.cluster.registry import routers

        per_replica: dict[Any, dict[str, Any]] = {}
        for r in routers(self.app_name, self.deployment_name):
            per_replica.update(r.index.replica_stats())
        total: dict[str, Any] = {}
        for s in per_replica.values():
            for k, v in s.items():
                if isinstance(v, (int, float)):
                    total[k] = total.get(k, 0) + v
        q = total.get("prefix_cache.query_tokens", 0)
        total["prefix_cache.hit_rate"] = total.get("prefix_cache.hit_tokens", 0) / q if q else 0.0
        blocks = total.get("kv.total_blocks", 0)
        total["kv.usage"] = (blocks - total.get("kv.free_blocks", 0)) / blocks if blocks else 0.0
        total["cluster.replicas_reporting"] = len(per_replica)
        return total

    # ------------------------------------------------------------------ bookkeeping
    def _closed_stream(self, stream: RemoteStream) -> None:
        self._streams.discard(stream)

    def _record_route(self, request_id: str, replica: str, attempt: int) -> None:
        self.routes[request_id] = {"replica": replica, "attempt": attempt}
        self.routes.move_to_end(request_id)
        while len(self.routes) > MAX_ROUTES:
            self.routes.popitem(last=False)
