"""``EngineReplica``: the Ray Serve deployment class whose replicas each run one engine core.

Each replica runs an ``EngineCore`` on its core loop (``LocalCoreClient``, as an in-process
``AsyncEngine`` does); the cluster ingress's ``AsyncEngine`` reaches it through
``cluster/ray_core.py`` (``RayCoreClient``), which validates, tokenizes, detokenizes and fans
out ``n`` at the ingress. Methods (called through a ``DeploymentHandle``):

* ``generate(payload, *, route)`` — a streaming method: ``payload`` is one msgpack-encoded
  ``AddRequest`` (one completion, validated at the ingress: decoded trusted here). A full
  waiting queue raises ``EngineOverloadedError`` before the first item; then it yields
  ``{"accepted": <replica>, "request_id": ...}``, then msgpack-encoded lists of ``TokenDelta``
  (whatever accumulated since the last item: fewer, larger Ray objects under load) until the
  request's last. Cancelling the call (the client went away) aborts the engine request.
  ``route`` (a ``RouteHint``) is only for the router; the replica ignores it.
* ``describe()`` — the core's ``Ready`` fields (``ModelInfo``, the longest token's characters,
  the salt parts the engine hashes with, the model's request defaults, the chat template), so
  the ingress's ``InputProcessor`` checks and keys requests exactly as the engine does.
* ``record_routing_stats()`` — Ray calls it every ``request_routing_stats_period_s``: load
  (running, waiting), numeric engine stats (for the ingress's aggregated ``/metrics``), and the
  cache contents the router corrects its index with: the 64-bit keys of the radix-tree nodes
  holding a checkpoint (joint-hit boundaries; every unit boundary on a model without GDN
  layers) and of the other unit-boundary nodes (KV only), most recently used first, capped;
  with cache events on, where they are published (``kv_events``: endpoints this node's
  address replaces a wildcard of), which the router then follows instead of the keys.
* ``check_health()`` — raises once the engine loop is dead, so Ray replaces the replica.
* ``check_integrity()`` — the core's accounting, checked between two steps.

Every method is a coroutine, so it runs on the replica's event loop beside the engine loop
(Ray may run plain methods in a thread pool). Reading the cache for a report: the radix tree is walked on the event loop, preferably
between two engine steps; if the engine is busy for longer than ``report_wait_s`` it is read
while a step runs (read-only; a walk torn by a concurrent insert is retried, and a report
that is slightly stale is harmless: it is a routing hint).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from deltaserve.cluster.affinity import pack_keys, short_key
from deltaserve.cluster.kv_index import connectable
from deltaserve.engine.constraint import trusted_decode
from deltaserve.engine.errors import EngineDeadError
from deltaserve.engine.messages import AddRequest, StepOutputs, TokenDelta
from deltaserve.logs import get_logger

log = get_logger("deltaserve.cluster")


def node_address() -> str:
    """This machine's address as other nodes of the Ray cluster reach it."""
    import ray.util  # (Ray is there: this runs in a replica)

    return str(ray.util.get_node_ip_address())


#: engine stats forwarded in reports (numeric values only)
_STAT_PREFIXES = (
    "tokens.",
    "requests.",
    "steps.",
    "prefix_cache.",
    "scheduler.",
    "checkpoints.",
    "kv.",
    "live_slots.",
)


def _replica_identity() -> tuple[str, str | None]:
    """(short replica id, Ray actor name) when running in a Serve replica."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        name = ctx.replica_id.unique_id
    except Exception:  # not in a replica (unit tests)
        name = f"local-{uuid.uuid4().hex[:6]}"
    try:
        import ray

        actor = ray.get_runtime_context().get_actor_name()
    except Exception:
        actor = None
    return name, actor


def cache_keys(core: Any, max_keys: int) -> tuple[list[int], list[int]] | None:
    """(checkpoint keys, KV-only unit keys) of an ``EngineCore``'s prefix cache, most recently
    used first; None if its cache cannot be read."""
    cache = getattr(core, "cache", None)
    tree = getattr(cache, "tree", None)
    if tree is None:
        return None
    unit, bs, has_gdn = int(cache.unit), int(cache.block_size), bool(cache.has_gdn)
    for _ in range(5):
        try:
            ckpt: list[tuple[int, int]] = []
            kv: list[tuple[int, int]] = []
            for node in list(tree.nodes()):
                if (node.depth * bs) % unit:
                    continue
                if not has_gdn or node.checkpoint_slot is not None:
                    ckpt.append((node.last_access, node.key))
                else:
                    kv.append((node.last_access, node.key))
            break
        except RuntimeError:  # the tree changed under the walk (a step committing): again
            continue
    else:
        return None
    ckpt.sort(reverse=True)
    kv.sort(reverse=True)
    return [short_key(k) for _, k in ckpt[:max_keys]], [short_key(k) for _, k in kv[:max_keys]]


class EngineReplica:
    """One engine core per Ray Serve replica (module docstring); the ``OutputSink`` of its core
    client, which hands each request's deltas to the ``generate`` call streaming it."""

    async def __init__(
        self, engine_config: dict[str, Any], *, max_report_keys: int = 8192, report_wait_s: float = 0.05
    ) -> None:
        from deltaserve.engine import EngineConfig
        from deltaserve.engine.front.local_core import LocalCoreClient

        self.config = EngineConfig.from_dict(engine_config)
        self.local = LocalCoreClient(self.config)
        self._queues: dict[str, asyncio.Queue[TokenDelta]] = {}  # request id -> its call's deltas
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(AddRequest)
        self._dead: str | None = None
        self.ready = await self.local.start(self)
        self.name, self.actor_name = _replica_identity()
        self.epoch = uuid.uuid4().hex[:12]  # a restarted replica's reports never look like old ones
        self.seq = 0
        self.max_report_keys = max_report_keys
        self.report_wait_s = report_wait_s
        log.info("cluster.replica_ready", replica=self.name, **self.ready.model_info.capacity)

    # ------------------------------------------------------------------ OutputSink
    def on_outputs(self, outputs: StepOutputs) -> None:
        for d in outputs.deltas:
            queue = self._queues.get(d.request_id)
            if queue is not None:
                queue.put_nowait(d)

    def on_dead(self, message: str) -> None:
        self._dead = message
        for rid, queue in self._queues.items():
            queue.put_nowait(TokenDelta(rid, [], finish_reason="error", error=message))

    # ------------------------------------------------------------------ requests
    async def generate(self, payload: bytes, *, route: Any = None) -> AsyncIterator[Any]:
        with trusted_decode():  # validated (its id unique: TAG:N) by the ingress: not checked again
            add = self._dec.decode(payload)
        rid = add.request_id
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self.local.check_capacity(1)
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[rid] = queue
        self.local.add_requests([add])
        finished = False
        try:
            yield {"accepted": self.name, "request_id": rid}
            while not finished:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                finished = any(d.finish_reason is not None for d in batch)
                yield self._enc.encode(batch)
        finally:
            self._queues.pop(rid, None)
            if not finished:  # a call left early (cancelled): the request is aborted
                self.local.abort_requests([rid])

    # ------------------------------------------------------------------ introspection
    async def describe(self) -> dict[str, Any]:
        """The core's ``Ready`` fields and who answers."""
        core = self.local.core
        ready = self.ready
        return {
            **msgspec.structs.asdict(ready.model_info),
            "replica": self.name,
            "actor_name": self.actor_name,
            "model_folder": str(core.loaded.path),
            "salt_parts": list(ready.salt_parts),
            "max_token_chars": ready.max_token_chars,
            "sampling_defaults": dict(ready.sampling_defaults),
            "sampling_source": ready.sampling_source,
            "chat_template": ready.chat_template,
            "has_gdn": bool(core.spec.num_gdn_layers),
        }

    async def stats(self) -> dict[str, Any]:
        return dict(self.local.stats())

    async def check_integrity(self) -> None:
        await self.local.check_integrity()

    async def record_routing_stats(self) -> dict[str, Any]:
        self.seq += 1
        stats = self.local.stats()
        report: dict[str, Any] = {
            "replica": self.name,
            "epoch": self.epoch,
            "seq": self.seq,
            "time": time.time(),
            "running": int(stats.get("scheduler.running", 0)),
            "waiting": int(stats.get("scheduler.waiting", 0)),
            "stats": {
                k: v
                for k, v in stats.items()
                if k.startswith(_STAT_PREFIXES) and isinstance(v, (int, float)) and not isinstance(v, bool)
            },
        }
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.report_wait_s
        while self.local.in_step and loop.time() < deadline:
            await asyncio.sleep(0.002)  # prefer a moment between two steps
        try:
            keys = cache_keys(self.local.core, self.max_report_keys)
        except Exception:  # a cache layout this code does not know: no keys, predictions only
            log.exception("cluster.report_keys_failed", replica=self.name)
            keys = None
        if keys is not None:
            report["ckpt_keys"], report["kv_keys"] = pack_keys(keys[0]), pack_keys(keys[1])
        events = getattr(self.local.core, "kv_events", None)
        if events is not None:  # where the router subscribes (``cluster/kv_feed.py``)
            pub, host = events.publisher, node_address()
            report["kv_events"] = {
                "endpoint": connectable(pub.endpoint, host),
                "replay_endpoint": connectable(pub.replay_endpoint, host) if pub.replay_endpoint else None,
                "topic": self.local.core.config.kv_events.topic,
            }
        return report

    async def check_health(self) -> None:
        if not self.local.is_healthy():
            raise RuntimeError(f"replica {self.name}: the engine loop is not running")

    async def __del__(self) -> None:
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(TokenDelta(rid, [], finish_reason="abort", error="replica shut down"))
        await self.local.shutdown()
