"""The cache-policy simulator: a workload replayed through the real torch-free scheduler and
cache manager at given budgets, per checkpoint admission policy, against an oracle.

* ``cli`` — the command line (run it as ``python tools/simulate_cache.py``)
* ``simulation`` — ``Simulation``: the scheduler and cache manager on a virtual clock
* ``disk`` — the disk tier's in-memory store and reader
* ``report`` — tables, offline bounds and the sweep plot
* ``bounds`` — the offline (Belady-style) bounds on the hit rate
* ``model_sizes`` — a model's KV bytes per token and checkpoint bytes, from its config

Nothing here imports torch.
"""
