#!/usr/bin/env python
"""Cache-policy simulator, the command: ``python tools/simulate_cache.py --help``.

The simulator is the ``tools/sim/`` package (``deltaserve.tools.sim``); this file is its
entry point, kept at the top of ``tools/`` beside ``loadgen.py``. Every option and the
printed tables: ``tools/sim/cli.py``.
"""

from __future__ import annotations

if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool
    from deltaserve.tools.sim.cli import main

    run_tool(main, "simulate_cache")
