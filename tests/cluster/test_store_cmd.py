"""``deltaserve store``: a master (and a client lending memory) on a free 127.0.0.1 port, its
address on stderr, a store that engines' clients can publish to and read from, a clean stop
on SIGTERM and on SIGINT (exit 0, the master gone with it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltaserve.cache.disk_format import StoreIdentity
from deltaserve.cache.remote_client import MooncakeClient
from deltaserve.cache.remote_master import free_port
from deltaserve.cache.remote_store import RemoteStore
from deltaserve.cache.types import DiskItemKind
from tests.cache.remote_helpers import require_mooncake

ROOT = Path(__file__).resolve().parents[2]
IDENT = StoreIdentity("m", "w", "float32", 4, 4, "salt", 8, 16)


def _start(port: int, err: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "deltaserve", "store", "--host", "127.0.0.1", "--port", str(port),
           "--segment-bytes", "32MiB"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err.open("wb"))


def _wait_for(err: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float = 90.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = err.read_text(errors="replace")
        if text in got:
            return got
        assert proc.poll() is None, f"deltaserve store exited {proc.returncode}: {got[-2000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} on stderr: {err.read_text(errors='replace')[-2000:]}")


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_store_serves_the_remote_tier_and_stops_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    require_mooncake()
    port = free_port()
    err = tmp_path / "stderr.txt"
    proc = _start(port, err)
    try:
        text = _wait_for(err, "engines: --remote-cache mooncake://127.0.0.1:", proc)
        assert f"--remote-cache mooncake://127.0.0.1:{port}" in text
        url = f"mooncake://127.0.0.1:{port}"
        a = RemoteStore(MooncakeClient(url, segment_bytes=0, buffer_bytes=16 << 20, timeout_s=10.0), IDENT)
        assert a.client.wait_ready(60)
        a.put(DiskItemKind.KV, 1, 0, b"k" * 8, 0.0)
        a.put(DiskItemKind.CHECKPOINT, 1, 1, b"c" * 16, 4.0)
        assert a.flush(30) and a.stats()["remote.published"] == 1
        b = RemoteStore(MooncakeClient(url, segment_bytes=0, buffer_bytes=16 << 20, timeout_s=10.0), IDENT)
        assert b.lookup([1], [1]) == [1]
        assert b.read_path([1], 0, 1, 8, 16) == ([b"k" * 8], b"c" * 16)
        a.close()
        b.close()
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
        assert "stopping" in err.read_text(errors="replace")
        deadline = time.monotonic() + 10
        while _port_open(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _port_open(port), "the master outlived deltaserve store"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_store_refuses_a_bad_segment_size(tmp_path: Path) -> None:
    require_mooncake()
    err = tmp_path / "stderr.txt"
    r = subprocess.run(
        [sys.executable, "-m", "deltaserve", "store", "--segment-bytes", "lots"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.startswith("deltaserve store: error: --segment-bytes = 'lots'")
    del err
