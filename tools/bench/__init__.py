"""The benchmarks, each a script (``python tools/bench/bench_engine.py --help``) on one harness
(``harness.py``: interleaved pairs, medians with their spread, what else ran on the box, and
``--json PATH`` in one shape). Where each one's numbers are quoted: ``bench_peers.md`` and
README.md's "Tools" list.
"""
