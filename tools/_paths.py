"""Make ``python tools/<script>.py`` work from anywhere: the repository root goes on
``sys.path`` and the ``tools/`` folder itself comes off it (so ``metrics.py`` etc. never
shadow an installed package of the same name)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"


def setup() -> Path:
    def is_tools(p: str) -> bool:
        try:
            return Path(p or ".").resolve() == TOOLS
        except OSError:
            return False

    sys.path[:] = [p for p in sys.path if not is_tools(p)]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return ROOT
