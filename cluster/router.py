"""``PrefixAffinityRouter``: a Ray Serve ``RequestRouter`` over ``deltaserve.cluster.affinity``.

It runs inside every process that holds a handle to the engine deployment (the ingress
replicas), on the handle's router loop:

* ``choose_replicas`` reads the request's ``RouteHint`` (``route=`` keyword of
  ``EngineReplica.generate``, computed once at the ingress), ingests any new routing-stats
  report of the candidates, and returns ranks from ``AffinityIndex.choose`` (or two random
  replicas: power of two choices). Ray then takes the least loaded replica of the first rank
  that has room (``max_ongoing_requests``), else the next rank, else backs off and asks again.
* ``on_request_routed`` / ``on_request_completed`` feed the index's predictions;
  ``update_replicas`` / ``on_replica_actor_died`` make it forget replicas that are gone.
* With cache events (a replica's report names its ``kv_events`` endpoint), a replica's view is
  fed from its event stream (``cluster/kv_feed.py``) instead of its polled keys, which stay
  the fallback; ``kv_events=False`` in ``request_router_kwargs`` turns that off.
* Loads are Ray's per-replica queue-length cache (requests in flight, kept by the router
  itself), or the replica's last reported running + waiting when the cache entry is stale.

``initialize_state`` takes ``request_router_kwargs``: ``affinity`` (False: power of two
choices only, the baseline ``--router pow2``; reports are still read, for ``/metrics``), the
``AffinityPolicy`` fields and the ``AffinityIndex`` options.

Code in the same process reads the routers' state through ``registry.routers()``
(the ingress's ``GET /cluster/status`` and its aggregated ``/metrics``).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deltaserve import logs
from deltaserve.cluster import registry
from deltaserve.cluster.affinity import AffinityIndex, AffinityPolicy, RouteHint
from deltaserve.cluster.kv_feed import EventFeeds

# Ray Serve pickles this module *by value* into every process holding a handle (see
# deltaserve.cluster.registry): module-level state here must stay immutable and picklable.
routers = registry.routers


def replica_name(replica_id: Any) -> str:
    """The short id a replica reports itself by (``ReplicaID.unique_id``)."""
    return str(getattr(replica_id, "unique_id", replica_id))


def hint_of(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None:
        return None
    hint = pending_request.kwargs.get("route") if pending_request.kwargs else None
    if isinstance(hint, RouteHint):
        return hint
    if isinstance(hint, dict) and "keys" in hint:
        return RouteHint(tuple(hint["keys"]), int(hint["unit"]), int(hint["num_tokens"]))
    return None


class PrefixAffinityRouter(RequestRouter):
    """Routes a request to the replica that likely holds its longest joint prefix, balanced
    against load (module docstring)."""

    def initialize_state(
        self,
        affinity: bool = True,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 8,
        balance_rel_threshold: float = 1.5,
        load_cost_tokens: float = 0.0,
        kv_affinity: bool = True,
        max_predicted_keys: int = 65536,
        prediction_ttl_s: float = 600.0,
        report_margin_s: float = 1.0,
        kv_events: bool = True,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise TypeError(f"PrefixAffinityRouter: unknown options {sorted(unknown)}")
        self.affinity = bool(affinity)
        policy = AffinityPolicy(
            cache_threshold=cache_threshold,
            balance_abs_threshold=balance_abs_threshold,
            balance_rel_threshold=balance_rel_threshold,
            load_cost_tokens=load_cost_tokens,
            kv_affinity=kv_affinity,
        )
        self.index = AffinityIndex(
            policy,
            max_predicted_keys=max_predicted_keys,
            prediction_ttl_s=prediction_ttl_s,
            report_margin_s=report_margin_s,
        )
        self.routed: dict[str, int] = {}
        # replicas that publish cache events feed their view from them (``cluster/kv_feed.py``)
        self.feeds: EventFeeds | None = EventFeeds() if kv_events else None
        registry.register(self)

    # ------------------------------------------------------------------ identity
    @property
    def deployment_name(self) -> str:
        return self._deployment_id.name

    # ------------------------------------------------------------------ routing
    def _load(self, replica: RunningReplica) -> int:
        q = self.replica_queue_len_cache.get(replica.replica_id)
        if q is not None:
            return int(q)
        view = self.index.views.get(replica.replica_id)
        if view is not None and view.reported_load is not None:
            return view.reported_load
        return 0

    def _ingest_reports(self, replicas: list[RunningReplica]) -> None:
        for r in replicas:
            try:
                self.index.on_report(r.replica_id, r.routing_stats)
                if self.feeds is not None:
                    self.feeds.on_report(r.replica_id, r.routing_stats)
            except Exception:  # a malformed report must not stop routing
                logs.get_logger("deltaserve.cluster").exception(
                    "cluster.bad_report", replica=replica_name(r.replica_id)
                )
        if self.feeds is not None:
            self.feeds.refresh(self.index)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # back off between rounds when every choice is full (Ray's loop asks again)
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        self._ingest_reports(candidate_replicas)
        by_id = {r.replica_id: r for r in candidate_replicas}
        ids = list(by_id)
        ranks = None
        if self.affinity:
            loads = {r.replica_id: self._load(r) for r in candidate_replicas}
            decision = self.index.choose(hint_of(pending_request), loads)
            ranks = decision.ranks
        if ranks is None:
            ranks = self.index.pow2(ids)
        return [[by_id[rid] for rid in rank if rid in by_id] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key = replica_name(replica_id)
        self.routed[key] = self.routed.get(key, 0) + 1
        hint = hint_of(pending_request)
        if hint is not None:
            self.index.on_routed(replica_id, pending_request.metadata.internal_request_id, hint)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.index.on_completed(replica_id, internal_request_id)

    # ------------------------------------------------------------------ membership
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.set_replicas(r.replica_id for r in replicas)
        if self.feeds is not None:
            self.feeds.keep({r.replica_id for r in replicas})
        self._ingest_reports(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)
        if self.feeds is not None:
            self.feeds.forget(replica_id)
        logs.get_logger("deltaserve.cluster").warning(
            "cluster.replica_died", replica=replica_name(replica_id)
        )

    # ------------------------------------------------------------------ introspection
    def num_live_replicas(self) -> int:
        return len(self._replica_id_set)

    def status(self) -> dict[str, Any]:
        out = self.index.summary(name=replica_name)
        out["affinity"] = self.affinity
        out["routed"] = dict(self.routed)
        out["live_replicas"] = sorted(replica_name(r) for r in self._replica_id_set)
        return out
