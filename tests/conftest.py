"""Suite-wide setup.

Torch runs on one thread in the tests (this process, and the server and core processes they
start, which inherit the environment; ``engine.cpu_threads = 0`` takes ``OMP_NUM_THREADS``).
The tests drive tiny models while their own clients, servers and workers share the same
CPUs, where a second OpenMP thread mostly waits for a descheduled peer; one thread also
keeps float results the same from run to run. A caller's own ``OMP_NUM_THREADS`` wins.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Subprocesses a test starts (tests/serve_procs.py); any still running at its end are killed."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)
