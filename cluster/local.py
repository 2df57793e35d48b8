"""Start (or join) a Ray cluster, run the application on it, stop it: for the CLI, tests, benches.

::

    with RayCluster(num_cpus=2) as ray_cluster:                 # local, bound to 127.0.0.1
        url = ray_cluster.deploy(engine_config, ClusterConfig(replicas=2))
        ...                                                     # OpenAI API at url + "/v1"
        ray_cluster.undeploy()

``RAY_ADDRESS`` (or ``address=``) joins an existing cluster instead of starting one; then
nothing of the cluster is stopped on exit but our application.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from deltaserve.cluster.config import ClusterConfig
from deltaserve.logs import get_logger

log = get_logger("deltaserve.cluster")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (Ray Serve needs a number: it does not take port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RayCluster:
    """A Ray connection with Serve's HTTP proxy on ``host:port`` (module docstring)."""

    def __init__(
        self,
        *,
        address: str | None = None,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        quiet: bool = True,
    ) -> None:
        self.address = address if address is not None else os.environ.get("RAY_ADDRESS") or None
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.host = host
        self.port = port or free_port(host)
        self.quiet = quiet
        self.started_ray = False
        self.apps: list[str] = []

    @property
    def base_url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        if shown in ("0.0.0.0", "[::]"):
            shown = "127.0.0.1"
        return f"http://{shown}:{self.port}"

    def start(self) -> RayCluster:
        import ray
        from ray import serve

        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": not self.quiet}
            if self.address:
                kwargs["address"] = self.address
            else:
                kwargs["num_cpus"] = self.num_cpus
                if self.num_gpus is not None:
                    kwargs["num_gpus"] = self.num_gpus
                if self.host in ("127.0.0.1", "localhost"):
                    kwargs["_node_ip_address"] = "127.0.0.1"
            t0 = time.monotonic()
            ray.init(**kwargs)
            self.started_ray = not self.address
            log.info(
                "cluster.ray_ready", address=self.address or "local", seconds=round(time.monotonic() - t0, 1)
            )
        serve.start(http_options={"host": self.host, "port": self.port})
        return self

    def deploy(
        self,
        engine_config: Any,
        cluster: ClusterConfig | None = None,
        *,
        served_model_names: list[str] | None = None,
        timeout_s: float = 600.0,
    ) -> str:
        """Run the application (blocks until its replicas are up); its base URL."""
        from ray import serve

        from deltaserve.cluster.app import build_app

        cluster = cluster or ClusterConfig()
        app = build_app(engine_config, cluster, served_model_names=served_model_names)
        serve.run(
            app,
            name=cluster.app_name,
            route_prefix=cluster.route_prefix,
            blocking=False,
            _local_testing_mode=False,
        )
        self._wait_running(cluster.app_name, timeout_s)
        self.apps.append(cluster.app_name)
        prefix = cluster.route_prefix.rstrip("/")
        return self.base_url + prefix

    def _wait_running(self, app_name: str, timeout_s: float) -> None:
        from ray import serve

        deadline = time.monotonic() + timeout_s
        while True:
            st = serve.status().applications.get(app_name)
            status = getattr(st, "status", None)
            if str(status).endswith("RUNNING"):
                return
            if str(status).endswith("DEPLOY_FAILED"):
                raise RuntimeError(f"application {app_name!r} failed to deploy: {st.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"application {app_name!r} not running after {timeout_s}s: {st}")
            time.sleep(0.25)

    def replicas(self, app_name: str, deployment: str = "EngineReplica") -> int:
        """Running replicas of a deployment."""
        from ray import serve

        app = serve.status().applications.get(app_name)
        if app is None or deployment not in app.deployments:
            return 0
        return int(app.deployments[deployment].replica_states.get("RUNNING", 0))

    def undeploy(self, app_name: str | None = None) -> None:
        from ray import serve

        for name in [app_name] if app_name else list(self.apps):
            try:
                serve.delete(name)
            finally:
                if name in self.apps:
                    self.apps.remove(name)

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            if self.started_ray:
                serve.shutdown()
            else:
                self.undeploy()
        finally:
            if self.started_ray and ray.is_initialized():
                ray.shutdown()

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
