"""``deltaserve serve --replicas N [--router prefix|pow2]``: the server on a Ray cluster.

The package's entry point (``deltaserve/__main__.py``) adds these options to ``serve``
(``add_cluster_args``: no Ray import) and hands over to
``main_cluster`` when ``--replicas`` is given. A local Ray cluster is started (bound to
``--host``), or the one named by ``RAY_ADDRESS`` is joined; the application runs until
SIGINT/SIGTERM, then Serve shuts down gracefully (in-flight requests get Serve's graceful
shutdown time) and a local Ray is stopped.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from deltaserve.engine.errors import ConfigError


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "replicas on Ray Serve (pip install 'deltaserve[cluster]'; docs/cluster.md)"
    )
    g.add_argument(
        "--replicas", type=int, metavar="N",
        help="serve N engine replicas behind one ingress on a local Ray cluster (or RAY_ADDRESS)",
    )  # fmt: skip
    g.add_argument(
        "--router", choices=["prefix", "pow2"], default="prefix",
        help="prefix: prefix-affinity routing (default); pow2: power of two choices (cache-blind)",
    )  # fmt: skip
    g.add_argument(
        "--replica-cpus", type=float, default=1.0, metavar="C", help="CPUs per replica (default 1)"
    )
    g.add_argument(
        "--replica-gpus", type=float, default=0.0, metavar="G", help="GPUs per replica (default 0)"
    )
    g.add_argument(
        "--max-replicas",
        type=int,
        default=0,
        metavar="M",
        help="autoscale between N and M replicas (default off)",
    )
    g.add_argument(
        "--ingress-replicas", type=int, default=1, metavar="K", help="HTTP ingress replicas (default 1)"
    )
    g.add_argument(
        "--max-ongoing-requests", type=int, default=64, metavar="R",
        help="requests in flight per replica before the router waits (default 64)",
    )  # fmt: skip
    g.add_argument(
        "--router-option", action="append", default=[], metavar="KEY=VALUE",
        help="router option, e.g. cache_threshold=0.5, balance_abs_threshold=8 (repeatable)",
    )  # fmt: skip
    g.add_argument(
        "--ray-cpus", type=float, default=None, metavar="C",
        help="CPUs of a local Ray cluster (default: all of this machine's)",
    )  # fmt: skip


def _option(text: str) -> tuple[str, Any]:
    import json

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--router-option {text!r}: expected KEY=VALUE")
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


def cluster_config_from_args(args: argparse.Namespace) -> Any:
    from deltaserve.cluster.config import ClusterConfig

    return ClusterConfig(
        replicas=args.replicas,
        max_replicas=args.max_replicas,
        router=args.router,
        num_cpus=args.replica_cpus,
        num_gpus=args.replica_gpus,
        ingress_replicas=args.ingress_replicas,
        max_ongoing_requests=args.max_ongoing_requests,
        router_options=dict(_option(o) for o in args.router_option),
    )


def main_cluster(args: argparse.Namespace, engine_config: Any, server_config: Any, *, out: Any = None) -> int:
    """Run the application until a signal; the exit code."""
    out = out or sys.stdout
    try:
        cluster = cluster_config_from_args(args)
    except ConfigError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError:
        print(
            "deltaserve: error: --replicas needs Ray Serve: pip install 'deltaserve[cluster]'",
            file=sys.stderr,
        )
        return 2
    from deltaserve.cluster.app import ENGINE_DEPLOYMENT
    from deltaserve.cluster.local import RayCluster

    stop = threading.Event()
    seen: list[int] = []

    def on_signal(sig: int, frame: Any) -> None:
        seen.append(sig)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with RayCluster(num_cpus=args.ray_cpus, host=server_config.host, port=server_config.port) as rc:
            url = rc.deploy(engine_config, cluster, served_model_names=list(server_config.served_model_names))
            handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=cluster.app_name)
            info = handle.describe.remote().result(timeout_s=120)
            name = (list(server_config.served_model_names) or [str(engine_config.model.path)])[0]
            print(
                f"deltaserve: serving {name} at {url.rstrip('/')}/v1 (OpenAI-compatible; {cluster.replicas} "
                f"replicas, router {cluster.router}, Ray {'at ' + rc.address if rc.address else 'local'})",
                file=out,
            )
            print(
                "deltaserve: capacity per replica "
                + " ".join(f"{k}={v}" for k, v in info["capacity"].items()),
                file=out,
                flush=True,
            )
            while not stop.wait(0.5):
                pass
            print("deltaserve: stopping (Serve drains in-flight requests)", file=out, flush=True)
    except (RuntimeError, TimeoutError, OSError, ConfigError) as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 1
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    print("deltaserve: stopped", file=out, flush=True)
    return 0
