"""``deltaserve serve`` as a subprocess in tests: one command line, one start, one URL line.

Every server listens on 127.0.0.1 on a port the OS picks unless the test passes ``--port``;
the ``procs`` fixture (tests/conftest.py) kills whatever a test left running.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

#: the command, loopback only
SERVE = [sys.executable, "-m", "deltaserve", "serve", "--host", "127.0.0.1"]


def popen_serve(
    procs: list[subprocess.Popen[str]], *args: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start ``deltaserve serve ARGS`` with piped, unbuffered output; ``procs`` owns it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [*SERVE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env
    )
    procs.append(proc)
    return proc


def served_url(proc: subprocess.Popen[str], model: str = "builtin:tiny-qwen3.5") -> str:
    """The ``.../v1`` URL from the server's first stdout line (its stderr when it died instead)."""
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith(f"deltaserve: serving {model} at http://127.0.0.1:"), first + (
        proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
    )
    return first.split(" at ")[1].split()[0]
