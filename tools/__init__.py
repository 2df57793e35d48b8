"""deltaserve tools: load generator, workloads, metrics and the cache-policy simulator.

Run them as scripts (``python tools/loadgen.py``); they import the project as
``deltaserve.*`` (installed by ``tools/setup.sh``), and this folder installs as
``deltaserve.tools``. ``workloads``, ``metrics`` and ``simulate_cache`` never import torch.
"""
