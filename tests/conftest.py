"""Suite-wide setup.

Engines built by the tests (in this process and in the server processes they start) run
torch on one thread: ``engine.cpu_threads = 0`` takes ``OMP_NUM_THREADS`` when it is set.
The tests drive tiny models while their own clients, servers and workers share the same
CPUs, where a second OpenMP thread mostly waits for a descheduled peer (the default suite
took 10 minutes instead of 4 on a 2-core box). A caller's own ``OMP_NUM_THREADS`` wins.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
