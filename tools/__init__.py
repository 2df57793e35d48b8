"""deltaserve tools: load generator, workloads, metrics and the cache-policy simulator.

Run them as scripts from the repository root (``python tools/loadgen.py``); each script
puts the repository root on ``sys.path`` itself. ``workloads``, ``metrics`` and
``simulate_cache`` never import torch.
"""
