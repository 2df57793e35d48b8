"""``python -m deltaserve serve ...``: the same command line as the ``deltaserve`` console script."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from deltaserve.server.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
