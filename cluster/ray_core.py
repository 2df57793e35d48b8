"""RayCoreClient: the core client (``engine/front/core_client.py``) of the cluster ingress, whose
cores run in Ray Serve replicas (``cluster/replica.py``) behind the prefix-affinity router.

The ingress is an ``AsyncEngine`` over this client (``cluster/app.py``): validation,
tokenization, detokenization, stop strings and ``n`` fan-out happen at the ingress, as in every
placement; each core request (one completion) is one streaming call of the replica's
``generate``, which streams token deltas.

* ``start()`` asks a replica to ``describe()`` itself: the ``Ready`` fields the front end builds
  its ``InputProcessor`` from (its tokenizer is loaded at the ingress).
* Each request goes out msgpack-encoded (the replica decodes it trusted: validated once, here)
  with a route hint (``route_hint``: its joint-prefix keys, the engine's chained block hashes
  with the request's salt) that only the router reads.
* Replica faults: a replica that dies (or cannot be reached) before the request produced any
  output is retried on another one (``max_retries``; the router has forgotten the dead one);
  after output, or when the replica refuses the request (a typed error), the request ends with
  ``finish_reason="error"`` and an ``error`` naming the replica. An abort cancels the remote
  call, which aborts the request on its replica.
* ``stats()`` sums the numeric engine stats the replicas sent with their last routing-stats
  reports (at most one report period old); ``check_capacity`` refuses a request when the
  replicas' waiting queues, summed, are full.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import msgspec

from deltaserve.cluster.affinity import RouteHint, route_keys
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.errors import EngineDeadError
from deltaserve.engine.front.client import ModelInfo
from deltaserve.engine.front.core_client import check_waiting
from deltaserve.engine.messages import AddRequest, Ready, StepOutputs, TokenDelta
from deltaserve.logs import get_logger

if TYPE_CHECKING:
    from deltaserve.engine.constraint import Constraint
    from deltaserve.engine.front.core_client import OutputSink
    from deltaserve.engine.front.input_processor import InputProcessor

log = get_logger("deltaserve.cluster")

#: most recent request id -> replica records kept for GET /cluster/routes
MAX_ROUTES = 4096
#: core id -> user request id entries kept at most. An entry leaves when its core request ends
#: or is aborted; the siblings of an ``n > 1`` request aborted before they were sent never
#: reach either, so the oldest entries go first beyond this bound (far above any live count).
MAX_USERS = 4 * MAX_ROUTES

_DELTAS = msgspec.msgpack.Decoder(list[TokenDelta])


def route_hint(prompt_token_ids: list[int], salt: bytes, *, block_size: int, unit: int) -> RouteHint:
    """The router's hint for a request: its joint-prefix keys at unit boundaries."""
    keys = route_keys(prompt_token_ids, block_size=block_size, unit=unit, salt=salt)
    return RouteHint(tuple(keys), unit, len(prompt_token_ids))


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


class RayCoreClient:
    """``CoreClient`` over the engine deployment's ``DeploymentHandle`` (module docstring)."""

    input_processor: InputProcessor | None = None  # the front end builds its own
    core_pid: int | None = None  # the cores run in the replicas' processes

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
        self._tag = f"{os.getpid()}-{os.urandom(3).hex()}"  # core ids of this ingress: TAG:N
        # core id -> the user's request id (for ``routes``); bounded by MAX_USERS, oldest first
        self._users: OrderedDict[str, str] = OrderedDict()
        self.info: dict[str, Any] = {}  # a replica's describe()
        self.routes: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.counters = {"requests": 0, "retries": 0, "replica_failures": 0, "failed": 0}
        self._model: ModelInfo | None = None
        self._sink: OutputSink | None = None
        self._calls: dict[str, asyncio.Task[None]] = {}  # core id -> the task streaming its call
        self._seq = itertools.count()
        self._enc = msgspec.msgpack.Encoder()
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self, sink: OutputSink) -> Ready:
        """Ask a replica to describe itself."""
        info = dict(await self.handle.describe.remote())
        self._sink = sink
        ready = self.prepare(info)
        log.info("cluster.ingress_ready", model=ready.model_info.name, unit=ready.model_info.checkpoint_unit)
        return ready

    def prepare(self, info: dict[str, Any]) -> Ready:
        """The ``Ready`` of a replica's ``describe()``."""
        self.info = dict(info)
        self._model = ModelInfo(**{f: info[f] for f in ModelInfo.__struct_fields__ if f in info})
        return Ready(
            self._model,
            list(info["salt_parts"]),
            int(info["max_token_chars"]),
            0,
            {},
            sampling_defaults=dict(info.get("sampling_defaults") or {}),
            sampling_source=str(info.get("sampling_source", "")),
            chat_template=info.get("chat_template"),
        )

    async def shutdown(self) -> None:
        self._closed = True
        calls = list(self._calls.values())
        for task in calls:
            task.cancel()
        for task in calls:
            with contextlib.suppress(BaseException):
                await task
        self._calls.clear()

    def is_healthy(self) -> bool:
        """Started, not shut down, and (once a router exists) at least one live replica."""
        if self._model is None or self._closed:
            return False
        from deltaserve.cluster.registry import routers

        rs = routers(self.app_name, self.deployment_name)
        return not rs or any(r.num_live_replicas() for r in rs)

    # ------------------------------------------------------------------ requests
    def core_ids(self, request_id: str, n: int) -> list[str]:
        """``TAG:N``: ingress replicas sharing an engine replica never collide."""
        ids = [f"{self._tag}:{next(self._seq)}" for _ in range(n)]
        self._users.update(dict.fromkeys(ids, request_id))
        while len(self._users) > MAX_USERS:
            self._users.popitem(last=False)
        return ids

    def add_requests(self, adds: list[AddRequest]) -> None:
        assert self._model is not None
        for add in adds:
            hint = route_hint(
                add.prompt_token_ids,
                add.cache_salt,
                block_size=self._model.block_size,
                unit=self._model.checkpoint_unit,
            )
            self.counters["requests"] += 1
            task = asyncio.ensure_future(self._stream(add.request_id, self._enc.encode(add), hint))
            self._calls[add.request_id] = task

    def abort_requests(self, request_ids: list[str]) -> None:
        """Cancel their calls (the replica aborts each request whose call is cancelled)."""
        for rid in request_ids:
            task = self._calls.pop(rid, None)
            self._users.pop(rid, None)
            if task is not None:
                task.cancel()

    def check_capacity(self, n: int) -> None:
        """The replicas' waiting requests (as last reported), summed, against ``max_waiting``
        per reporting replica."""
        per_replica = self._replica_stats()
        if not per_replica:
            return
        waiting = sum(int(s.get("scheduler.waiting", 0)) for s in per_replica.values()) + n - 1
        check_waiting(waiting, self.config.scheduler.max_waiting * len(per_replica))

    # ------------------------------------------------------------------ asking the replicas
    def stats(self) -> dict[str, Any]:
        """The replicas' engine stats, summed (ratios recomputed from the sums)."""
        per_replica = self._replica_stats()
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

    async def fetch_stats(self) -> dict[str, Any]:
        return self.stats()

    async def check_integrity(self) -> None:
        """One replica's accounting (the one the handle picks)."""
        await self.handle.check_integrity.remote()

    async def compile_constraint(self, constraint: Constraint) -> None:
        """Nothing ahead of time: a request's grammar compiles on its replica (parked there under
        the same deadline)."""

    # ------------------------------------------------------------------ one core request
    async def _stream(self, rid: str, payload: bytes, hint: RouteHint) -> None:
        """Stream one core request's deltas to the front end; retry it elsewhere while its
        replica failed before any output; end it with an error otherwise."""
        attempts, received, replica = 0, False, None
        while True:
            attempts += 1
            gen = self.handle.options(stream=True).generate.remote(payload, route=hint)
            try:
                while True:
                    try:
                        item = await gen.__anext__()
                    except StopAsyncIteration:
                        self._fail(rid, f"replica {replica} ended the stream before the request finished")
                        return
                    if isinstance(item, dict):
                        replica = str(item["accepted"])
                        self._record_route(self._users.get(rid, rid), replica, attempts)
                        continue
                    received = True
                    deltas = _DELTAS.decode(item)
                    self._deliver(deltas)
                    if any(d.finish_reason is not None for d in deltas):
                        self._end(rid)
                        return
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):  # already finished or gone
                    gen.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - sorted below
                with contextlib.suppress(Exception):
                    gen.cancel()
                cause = _unwrap(e)
                if is_replica_failure(e) or isinstance(cause, EngineDeadError):
                    self.counters["replica_failures"] += 1
                    if not received and attempts <= self.max_retries:
                        self.counters["retries"] += 1
                        log.warning("cluster.retry", request_id=rid, replica=replica, error=repr(e)[:300])
                        replica = None
                        continue  # the router avoids the dead replica
                    self._fail(rid, f"replica {replica or '?'} failed: {type(cause).__name__}: {cause}")
                else:
                    self._fail(rid, f"replica {replica or '?'}: {type(cause).__name__}: {cause}")
                return

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        if self._sink is not None and not self._closed:
            self._sink.on_outputs(StepOutputs(deltas))

    def _fail(self, rid: str, message: str) -> None:
        """End the core request with an error (nothing is lost silently)."""
        self._end(rid)
        log.error("cluster.request_failed", request_id=rid, error=message)
        self.counters["failed"] += 1
        self._deliver([TokenDelta(rid, [], finish_reason="error", error=message)])

    def _end(self, rid: str) -> None:
        self._calls.pop(rid, None)
        self._users.pop(rid, None)

    def _replica_stats(self) -> dict[Any, dict[str, Any]]:
        from deltaserve.cluster.registry import routers

        per_replica: dict[Any, dict[str, Any]] = {}
        for r in routers(self.app_name, self.deployment_name):
            per_replica.update(r.index.replica_stats())
        return per_replica

    def _record_route(self, request_id: str, replica: str, attempt: int) -> None:
        self.routes[request_id] = {"replica": replica, "attempt": attempt}
        self.routes.move_to_end(request_id)
        while len(self.routes) > MAX_ROUTES:
            self.routes.popitem(last=False)
