"""The Ray Serve application: an HTTP ingress (the OpenAI server) in front of N engine replicas.

::

    HTTP --> Serve proxy --> Ingress replica(s) ---handle + PrefixAffinityRouter---> EngineReplica x N
                             create_app(AsyncEngine over RayCoreClient)                an EngineCore each

``build_app(engine_config, cluster_config)`` returns the bound application for ``serve.run``.
The ingress serves every endpoint of ``deltaserve serve`` (``server/app.py`` over a
``AsyncEngine`` whose core client is ``RayCoreClient``: ``cluster/ray_core.py``) plus:

* ``GET /cluster/status`` — the router's view: live replicas, what each is believed to hold,
  decisions by reason, requests routed per replica; the ingress's retry/failure counters.
* ``GET /cluster/routes?request_id=ID`` — which replica served a request (the ``request_id``
  field of a completion request names it), for the last 4,096 requests.
"""

from __future__ import annotations

from typing import Any

import msgspec

from deltaserve.cluster.config import ClusterConfig

_encode = msgspec.json.Encoder().encode

ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"


class Ingress:
    """The HTTP ingress: ``create_app`` over an ``AsyncEngine`` whose core client is a
    ``RayCoreClient`` (module docstring)."""

    def __init__(
        self,
        engine_handle: Any,
        engine_config: dict[str, Any],
        served_model_names: list[str] | None = None,
        max_retries: int = 2,
    ) -> None:
        from deltaserve.cluster.ray_core import RayCoreClient
        from deltaserve.engine import AsyncEngine, EngineConfig

        app_name = None
        try:
            from ray import serve

            app_name = serve.get_replica_context().app_name
        except Exception:  # outside a replica (tests build it directly)
            pass
        self.engine_config = EngineConfig.from_dict(engine_config)
        self.served_model_names = list(served_model_names or [])
        self.client = RayCoreClient(
            engine_handle,
            self.engine_config,
            app_name=app_name,
            deployment_name=ENGINE_DEPLOYMENT,
            max_retries=max_retries,
        )
        self.engine = AsyncEngine(self.engine_config, client=self.client)

    def __serve_build_asgi_app__(self) -> Any:
        return build_ingress_asgi(self.engine, self.served_model_names)


def build_ingress_asgi(engine: Any, served_model_names: list[str] | None = None) -> Any:
    """``create_app(engine)`` (an ``AsyncEngine`` over a ``RayCoreClient``) plus the
    ``/cluster/*`` routes."""
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from deltaserve.cluster.registry import routers
    from deltaserve.server.app import create_app
    from deltaserve.server.config import ServerConfig

    remote = engine.client
    app = create_app(engine, ServerConfig(served_model_names=list(served_model_names or [])))

    async def status(request: Request) -> Response:
        rs = routers(remote.app_name, remote.deployment_name)
        body = {
            "model": engine.model_info.name if engine.started else None,
            "unit": engine.model_info.checkpoint_unit if engine.started else None,
            "ingress": dict(remote.counters),
            "routers": [r.status() for r in rs],
        }
        return Response(_encode(body), media_type="application/json")

    async def routes(request: Request) -> Response:
        rid = request.query_params.get("request_id")
        if rid is not None:
            entry = remote.routes.get(rid)
            if entry is None:
                return Response(
                    _encode({"error": f"no route recorded for {rid!r}"}), 404, media_type="application/json"
                )
            return Response(_encode({"request_id": rid, **entry}), media_type="application/json")
        return Response(_encode({"routes": dict(remote.routes)}), media_type="application/json")

    app.router.routes.append(Route("/cluster/status", status, methods=["GET"]))
    app.router.routes.append(Route("/cluster/routes", routes, methods=["GET"]))
    return app


def build_app(
    engine_config: Any, cluster: ClusterConfig | None = None, *, served_model_names: list[str] | None = None
) -> Any:
    """The Ray Serve application (pass to ``serve.run``)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deltaserve.cluster.replica import EngineReplica
    from deltaserve.cluster.router import PrefixAffinityRouter

    cluster = cluster or ClusterConfig()
    cfg = engine_config.to_dict()
    scaling: dict[str, Any] = {"num_replicas": cluster.replicas}
    if cluster.max_replicas > cluster.replicas:
        scaling = {
            "autoscaling_config": {
                "min_replicas": cluster.replicas,
                "max_replicas": cluster.max_replicas,
                "target_ongoing_requests": max(1, cluster.max_ongoing_requests // 2),
            }
        }
    engine = serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        ray_actor_options={"num_cpus": cluster.num_cpus, "num_gpus": cluster.num_gpus},
        max_ongoing_requests=cluster.max_ongoing_requests,
        health_check_period_s=cluster.health_check_period_s,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs=cluster.router_kwargs(),
            request_routing_stats_period_s=cluster.stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 5 * cluster.stats_period_s),
        ),
        **scaling,
    ).bind(cfg, max_report_keys=cluster.max_report_keys)
    ingress_cls = serve.ingress()(Ingress)
    ingress = serve.deployment(
        ingress_cls,
        name=INGRESS_DEPLOYMENT,
        num_replicas=cluster.ingress_replicas,
        ray_actor_options={"num_cpus": cluster.ingress_num_cpus},
        max_ongoing_requests=100_000,  # a proxy: the engine replicas apply back-pressure
    ).bind(engine, cfg, served_model_names or [], cluster.max_retries)
    return ingress
