"""deltaserve.cluster: N engine replicas on Ray Serve behind one OpenAI-compatible ingress, with
a prefix-affinity request router (``docs/cluster.md``).

::

    deltaserve serve --replicas 2 --router prefix        # local Ray cluster (or RAY_ADDRESS)

Modules: ``affinity`` (the routing logic: pure Python, no Ray, no torch), ``config``
(``ClusterConfig``), ``router`` (the Ray ``RequestRouter``), ``replica`` (the engine
deployment), ``ray_core`` (the ingress's core client over a handle), ``app`` (the Serve
application), ``local`` (start / join a cluster and deploy), ``cli`` (``deltaserve serve
--replicas``). The bench (prefix vs pow2 vs one engine under loadgen) is a tool:
``python -m deltaserve.tools.bench.bench_cluster``.

Ray is an optional dependency (``pip install 'deltaserve[cluster]'``); only ``router``,
``replica``, ``app``, ``local`` and ``cli`` (when run) need it.
"""
