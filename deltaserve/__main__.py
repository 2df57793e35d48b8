"""``python -m deltaserve serve ...``: the same command line as the ``deltaserve`` console script.

The entry point is where the single-engine server meets the cluster: ``serve`` gets the
cluster's options (``--replicas N``, ``--router``, ...), and ``--replicas`` hands the parsed
command to ``deltaserve.cluster.cli``; so ``server`` never imports ``cluster``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _replicas(args: argparse.Namespace, engine_config: Any, server_config: Any) -> int | None:
    """N engine replicas on Ray Serve (docs/cluster.md) when ``--replicas`` is given."""
    if not getattr(args, "replicas", None):
        return None
    from deltaserve.cluster.cli import main_cluster

    return main_cluster(args, engine_config, server_config)


def main(argv: Sequence[str] | None = None) -> int:
    from deltaserve.cluster.cli import add_cluster_args  # no Ray import
    from deltaserve.server.cli import main as serve_main

    return serve_main(argv, extra_args=[add_cluster_args], dispatch=_replicas)


if __name__ == "__main__":
    sys.exit(main())
