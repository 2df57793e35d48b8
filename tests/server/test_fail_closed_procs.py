"""``deltaserve serve`` with the engine core in its own process leaves nothing behind: the core's
ipc socket (a private folder in the temp folder) is removed on a clean stop, when the core is
killed and when it fails to start, and a start removes what killed runs left (only that);
``--api-server-count 2`` spreads connections over both front ends. Each server runs with
``TMPDIR`` set to the test's own folder, so the test sees only its own files."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from deltaserve.engine.core.ipc_files import RUN_DIR, pid_alive, remove_stale
from tests.serve_procs import popen_serve, served_url

SETTINGS = ["--set", "cache.memory_bytes=67108864", "--set", "logging.stats_interval_s=60", "--set",
            "scheduler.max_num_seqs=16"]  # fmt: skip


def start(
    procs: list[subprocess.Popen[str]], tmp: Path, *extra: str, expect_url: bool = True
) -> tuple[subprocess.Popen[str], str]:
    proc = popen_serve(
        procs, "--port", "0", "--log-level", "info", *SETTINGS, *extra, env={"TMPDIR": str(tmp)}
    )
    return proc, served_url(proc).removesuffix("/v1") if expect_url else ""


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not pid_alive(p.pid)
    return p.pid


def stale_socket(path: Path) -> None:
    """A unix socket file nobody listens on (what a killed core leaves)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


def our_entries(tmp: Path) -> list[str]:
    return sorted(e.name for e in tmp.iterdir() if e.name.startswith("deltaserve-"))


def run_folder_of(tmp: Path, pid: int) -> Path:
    (folder,) = [e for e in tmp.iterdir() if RUN_DIR.fullmatch(e.name) and e.name.split("-")[1] == str(pid)]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert [e.name for e in folder.iterdir()] == ["core"] and (folder / "core").is_socket()
    return folder


def test_remove_stale_takes_only_dead_runs_of_ours(tmp_path: Path) -> None:
    gone = dead_pid()
    dead = tmp_path / f"deltaserve-{gone}-abcd_123"
    dead.mkdir(mode=0o700)
    stale_socket(dead / "core")
    empty = tmp_path / f"deltaserve-{gone}-emptyrun"  # a run killed before its core bound
    empty.mkdir()
    live = tmp_path / f"deltaserve-{os.getpid()}-liverun1"  # its starter is alive
    live.mkdir()
    stale_socket(live / "core")
    crowded = tmp_path / f"deltaserve-{gone}-crowded1"  # holds something that is not our socket
    crowded.mkdir()
    stale_socket(crowded / "core")
    (crowded / "notes.txt").write_text("keep")
    plain = tmp_path / f"deltaserve-{gone}-plainfil"  # a file, not a folder
    plain.write_text("keep")
    other = tmp_path / f"deltaserve-x{gone}-abcdefgh"  # not our name
    other.mkdir()
    legacy_new = tmp_path / "deltaserve-core-0123456789ab"  # an older version's, but fresh
    stale_socket(legacy_new)
    legacy_old = tmp_path / "deltaserve-core-ba9876543210"
    stale_socket(legacy_old)
    os.utime(legacy_old, (1e9, 1e9))
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    legacy_live = tmp_path / "deltaserve-core-aaaaaaaaaaaa"
    listening.bind(str(legacy_live))
    listening.listen(1)
    os.utime(legacy_live, (1e9, 1e9))
    legacy_file = tmp_path / "deltaserve-core-bbbbbbbbbbbb"  # not a socket
    legacy_file.write_text("keep")
    os.utime(legacy_file, (1e9, 1e9))
    try:
        removed = remove_stale(str(tmp_path))
    finally:
        listening.close()
    assert sorted(removed) == sorted([str(dead), str(empty), str(legacy_old)])
    assert not dead.exists() and not empty.exists() and not legacy_old.exists()
    untouched = [live / "core", crowded / "core", crowded / "notes.txt", plain, other, legacy_new]
    for path in [*untouched, legacy_live, legacy_file]:
        assert path.exists(), path


def test_the_core_socket_is_removed_on_sigterm_and_stale_ones_at_start(
    procs: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    stale = tmp_path / f"deltaserve-{dead_pid()}-stale123"
    stale.mkdir(mode=0o700)
    stale_socket(stale / "core")
    proc, url = start(procs, tmp_path, "--engine-process")
    assert not stale.exists()  # removed when the core's address was made
    folder = run_folder_of(tmp_path, proc.pid)
    assert our_entries(tmp_path) == [folder.name]
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert our_entries(tmp_path) == []


def test_a_killed_core_leaves_no_socket(procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    proc, url = start(procs, tmp_path, "--engine-process")
    run_folder_of(tmp_path, proc.pid)
    core = int(
        subprocess.check_output(
            ["pgrep", "-P", str(proc.pid), "-f", "deltaserve.engine.core.core_proc"]
        ).split()[0]
    )
    os.kill(core, signal.SIGKILL)
    assert proc.wait(timeout=60) == 1
    assert our_entries(tmp_path) == []  # the server removed what the killed core could not


def test_a_core_that_fails_to_start_leaves_no_socket(
    procs: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()  # a folder without a model: the core fails to load it
    proc, _ = start(procs, tmp_path, "--engine-process", str(model), expect_url=False)
    assert proc.wait(timeout=120) != 0
    assert our_entries(tmp_path) == []


def listeners(port: int) -> int:
    """The IPv4 TCP sockets listening on ``port`` (``/proc/net/tcp``: state 0A)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for r in rows if r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A")


@pytest.mark.slow  # three processes load: about 25 s on a 2-core CPU
def test_two_front_ends_share_the_connections(procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    proc, url = start(procs, tmp_path, "--api-server-count", "2")
    seen: Counter[str] = Counter()
    for _ in range(100):  # a connection each
        with httpx.Client(base_url=url, timeout=30, headers={"Connection": "close"}) as http:
            r = http.get("/v1/models")
            assert r.status_code == 200
            seen[r.headers["x-deltaserve-frontend"]] += 1
    assert set(seen) == {"1", "2"} and min(seen.values()) >= 20, seen
    if sys.platform.startswith("linux"):  # one listening socket per front end, not one shared
        assert listeners(int(url.rsplit(":", 1)[1])) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert our_entries(tmp_path) == []
