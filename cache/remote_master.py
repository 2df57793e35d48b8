"""Starting a Mooncake Store master for one machine (``deltaserve store``; tests).

``start_master(port)`` runs ``mooncake_master`` (installed with the ``remote`` extra, beside
the Python executable) listening on ``host:port`` for clients' RPCs; clients join it with
``P2PHANDSHAKE`` (``cache/remote_client.py``), so no metadata server is needed. The master
keeps only metadata: objects live in the memory its clients lend (the engines'
``cache.remote_segment_bytes``, and ``deltaserve store --segment-bytes``'s own client).

``wait_listening`` waits until the port accepts a connection (the master is up) or the
process exits.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO


def master_binary() -> str | None:
    """The ``mooncake_master`` executable: beside this Python's, else on ``PATH``."""
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_master(
    port: int, host: str = "127.0.0.1", *, log: IO[bytes] | int | None = subprocess.DEVNULL
) -> subprocess.Popen[bytes]:
    """A ``mooncake_master`` serving RPCs on ``host:port`` (its metrics on a free port);
    ``FileNotFoundError`` when the binary is not installed."""
    binary = master_binary()
    if binary is None:
        raise FileNotFoundError("mooncake_master is not installed (the `remote` extra)")
    cmd = [
        binary,
        f"--rpc_port={port}",
        f"--rpc_address={host}",
        f"--metrics_port={free_port(host)}",
    ]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def wait_listening(proc: subprocess.Popen[bytes], host: str, port: int, timeout_s: float = 20.0) -> bool:
    """True once ``host:port`` accepts a connection; False if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False
