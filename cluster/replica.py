"""``EngineReplica``: the Ray Serve deployment class whose replicas each run one ``AsyncEngine``.

Methods (called through a ``DeploymentHandle``; ``deltaserve.cluster.remote`` is the caller):

* ``generate(prompt_ids, params, *, request_id, priority, cache_salt, route)`` — a streaming
  method: validates through ``AsyncEngine.generate`` (typed errors are raised before the first
  item), yields ``{"accepted": <replica>, "request_id": ...}``, then lists of
  ``RequestOutput`` deltas (whatever accumulated since the last item: fewer, larger Ray
  objects under load). Cancelling the call (the client went away) aborts the engine request.
  ``route`` (a ``RouteHint``) is only for the router; the replica ignores it.
* ``describe()`` — the engine's ``ModelInfo`` fields (model, limits, cache geometry, capacity),
  the longest token's characters and the salt parts the engine hashes with, so the ingress's
  ``InputProcessor`` checks and keys requests exactly as the engine does.
* ``record_routing_stats()`` — Ray calls it every ``request_routing_stats_period_s``: load
  (running, waiting), numeric engine stats (for the ingress's aggregated ``/metrics``), and the
  cache contents the router corrects its index with: the 64-bit keys of the radix-tree nodes
  holding a checkpoint (joint-hit boundaries; every unit boundary on a model without GDN
  layers) and of the other unit-boundary nodes (KV only), most recently used first, capped.
* ``check_health()`` — raises once the engine loop is dead, so Ray replaces the replica.

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
from deltaserve.logs import get_logger

log = get_logger("deltaserve.cluster")

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
    """One ``AsyncEngine`` per Ray Serve replica (module docstring)."""

    async def __init__(
        self, engine_config: dict[str, Any], *, max_report_keys: int = 8192, report_wait_s: float = 0.05
    ) -> None:
        from deltaserve.engine import AsyncEngine, EngineConfig

        self.config = EngineConfig.from_dict(engine_config)
        self.engine = AsyncEngine(self.config)
        await self.engine.start()
        self.name, self.actor_name = _replica_identity()
        self.epoch = uuid.uuid4().hex[:12]  # a restarted replica's reports never look like old ones
        self.seq = 0
        self.max_report_keys = max_report_keys
        self.report_wait_s = report_wait_s
        log.info("cluster.replica_ready", replica=self.name, **self.engine.model_info.capacity)

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        prompt: list[int],
        params: Any = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        route: Any = None,
    ) -> AsyncIterator[Any]:
        stream = self.engine.generate(
            prompt, params, request_id=request_id, priority=priority, cache_salt=cache_salt
        )
        yield {"accepted": self.name, "request_id": stream.request_id}
        queue: asyncio.Queue[Any] = asyncio.Queue()
        end = object()

        async def pump() -> None:
            try:
                async for out in stream:
                    queue.put_nowait(out)
            except Exception as e:  # reported to the consumer
                queue.put_nowait(e)
            finally:
                queue.put_nowait(end)

        task = asyncio.ensure_future(pump())
        try:
            done = False
            while not done:
                item = await queue.get()
                batch = []
                while True:
                    if item is end:
                        done = True
                        break
                    if isinstance(item, Exception):
                        raise item
                    batch.append(item)
                    if queue.empty():
                        break
                    item = queue.get_nowait()
                if batch:
                    yield batch
        finally:
            task.cancel()
            await stream.aclose()  # a request left early (cancelled call) is aborted

    # ------------------------------------------------------------------ introspection
    async def describe(self) -> dict[str, Any]:
        """The engine's ``ModelInfo`` fields, plus what an ingress's ``InputProcessor`` needs
        (``salt_parts``, ``max_token_chars``) and who answers."""
        core = self.engine.core
        processor = self.engine.input_processor
        return {
            **msgspec.structs.asdict(self.engine.model_info),
            "replica": self.name,
            "actor_name": self.actor_name,
            "model_folder": str(core.loaded.path),
            "salt_parts": list(processor.salt_parts),
            "max_token_chars": processor.max_token_chars,
            # the model's request defaults and the configured chat template: the ingress applies them
            "sampling_defaults": dict(processor.sampling_defaults),
            "chat_template": processor.tokenizer.chat_template if core.config.model.chat_template else None,
            "has_gdn": bool(core.spec.num_gdn_layers),
        }

    async def stats(self) -> dict[str, Any]:
        return dict(self.engine.stats())

    async def check_integrity(self) -> None:
        await self.engine.check_integrity()

    async def record_routing_stats(self) -> dict[str, Any]:
        self.seq += 1
        stats = self.engine.stats()
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
        while self.engine.in_step and loop.time() < deadline:
            await asyncio.sleep(0.002)  # prefer a moment between two steps
        try:
            keys = cache_keys(self.engine.core, self.max_report_keys)
        except Exception:  # a cache layout this code does not know: no keys, predictions only
            log.exception("cluster.report_keys_failed", replica=self.name)
            keys = None
        if keys is not None:
            report["ckpt_keys"], report["kv_keys"] = pack_keys(keys[0]), pack_keys(keys[1])
        return report

    async def check_health(self) -> None:
        if not self.engine.is_healthy():
            raise RuntimeError(f"replica {self.name}: the engine loop is not running")

    async def __del__(self) -> None:
        await self.engine.shutdown()
