"""ClusterConfig: how many engine replicas, where they run, and how requests are routed.

Built from the command line (``deltaserve serve --replicas N --router prefix ...``) or in
code for ``deltaserve.cluster.app.build_app``. Validated on construction (``ConfigError``),
like the engine's config sections. No Ray import here.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from deltaserve.engine.errors import ConfigError

ROUTERS = ("prefix", "pow2")


class ClusterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Replicas on Ray Serve (``docs/cluster.md``).

    replicas
        Engine replicas (each one ``AsyncEngine``); with ``max_replicas`` > ``replicas`` the
        deployment autoscales between them (Ray Serve autoscaling on requests in flight).
    router
        ``prefix``: the prefix-affinity router; ``pow2``: power of two choices only (the
        cache-blind baseline; same router class, affinity off).
    num_cpus / num_gpus
        Resources of one replica (Ray logical resources: a GPU replica gets
        ``CUDA_VISIBLE_DEVICES`` set by Ray; use ``--set model.device=cuda``).
    max_ongoing_requests
        Requests in flight per replica before the router sends elsewhere or waits (Ray
        Serve's back-pressure); keep it at or below the engine's ``max_num_seqs`` +
        ``max_waiting`` so an engine never refuses a request as overloaded.
    ingress_replicas / ingress_num_cpus
        The HTTP ingress (tokenizes, hashes, routes, streams): stateless, scale freely.
    stats_period_s
        How often each replica reports its load and cache contents to the routers.
    health_check_period_s
        How often Ray checks a replica (a dead engine loop fails it and it is replaced).
    app_name / route_prefix
        The Ray Serve application name and its HTTP route prefix.
    router_options
        ``PrefixAffinityRouter`` options: ``cache_threshold``, ``balance_abs_threshold``,
        ``balance_rel_threshold``, ``load_cost_tokens``, ``kv_affinity``,
        ``max_predicted_keys``, ``prediction_ttl_s``, ``report_margin_s``.
    max_retries
        Times the ingress re-sends a request whose replica died before it produced output.
    """

    replicas: int = 2
    max_replicas: int = 0
    router: Literal["prefix", "pow2"] = "prefix"
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 64
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.0
    stats_period_s: float = 1.0
    health_check_period_s: float = 2.0
    app_name: str = "deltaserve"
    route_prefix: str = "/"
    router_options: dict[str, Any] = {}
    max_retries: int = 2
    max_report_keys: int = 8192

    def __post_init__(self) -> None:
        def check(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"cluster.{what}")  # one line: the key, the value, the limit

        check(
            isinstance(self.replicas, int) and self.replicas >= 1,
            f"replicas = {self.replicas!r}: must be >= 1",
        )
        check(
            self.max_replicas == 0 or self.max_replicas >= self.replicas,
            f"max_replicas = {self.max_replicas}: 0 (fixed) or >= replicas ({self.replicas})",
        )
        check(self.router in ROUTERS, f"router = {self.router!r}: one of {ROUTERS}")
        for name, least in (
            ("num_cpus", 0),
            ("num_gpus", 0),
            ("max_ongoing_requests", 1),
            ("ingress_replicas", 1),
            ("ingress_num_cpus", 0),
            ("max_retries", 0),
            ("max_report_keys", 0),
        ):
            value = getattr(self, name)
            check(value >= least, f"{name} = {value!r}: must be >= {least}")
        for name in ("stats_period_s", "health_check_period_s"):
            value = getattr(self, name)
            check(value > 0, f"{name} = {value!r}: must be > 0")
        check(self.route_prefix.startswith("/"), f"route_prefix = {self.route_prefix!r}: must start with '/'")
        known = {
            "cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "load_cost_tokens",
            "kv_affinity", "max_predicted_keys", "prediction_ttl_s", "report_margin_s",
        }  # fmt: skip
        unknown = sorted(set(self.router_options) - known)
        check(not unknown, f"router_options: unknown {unknown}; known: {sorted(known)}")
        try:  # the policy's own range checks, now rather than in every router
            from deltaserve.cluster.affinity import AffinityPolicy

            AffinityPolicy(
                **{k: v for k, v in self.router_options.items() if k in AffinityPolicy.__dataclass_fields__}
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"cluster.router_options: {e}") from None

    def router_kwargs(self) -> dict[str, Any]:
        """``request_router_kwargs`` of the engine deployment."""
        return {"affinity": self.router == "prefix", **self.router_options}
