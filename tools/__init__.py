"""deltaserve tools: load generator, workloads, metrics, the cache-policy simulator, benches.

Run them as scripts (``python tools/loadgen.py``); they import the project as
``deltaserve.*`` (installed by ``tools/setup.sh``), and this folder installs as
``deltaserve.tools``. ``workloads``, ``metrics``, ``simulation``, ``sim_report`` and
``simulate_cache`` never import torch.
"""
