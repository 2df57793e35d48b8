"""``deltaserve serve --engine-process`` and ``--api-server-count 2`` as a user runs them: SIGTERM
drains the stream in flight through the front end and the core and exits 0 (no process left);
a killed core makes the server exit 1; two front ends share one core."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from deltaserve.engine.core.core_proc import pid_alive
from tests.serve_procs import popen_serve, served_url

SETTINGS = ["--set", "cache.memory_bytes=67108864", "--set", "logging.stats_interval_s=60", "--set",
            "scheduler.max_num_seqs=16"]  # fmt: skip


def start(procs: list[subprocess.Popen[str]], *extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = popen_serve(procs, "--port", "0", "--log-level", "info", *SETTINGS, *extra)
    return proc, served_url(proc)


def core_pids(stderr: str) -> set[int]:
    return {
        int(line.split("pid=")[1].split()[0]) for line in stderr.splitlines() if "core_proc.ready" in line
    }


def stream_with_signal(url: str, proc: subprocess.Popen[str], sig: int) -> list[dict]:
    """A stream of 24 tokens; ``sig`` sent to the server after its first frame. Its chunks."""
    body = {"prompt": "Hello", "max_tokens": 24, "ignore_eos": True, "stream": True}
    frames: list[str] = []
    with (
        httpx.Client(base_url=url, timeout=60) as http,
        http.stream("POST", "/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        frames.append(next(lines))
        threading.Timer(0.05, proc.send_signal, (sig,)).start()
        frames += list(lines)
    data = [f[6:] for f in frames if f.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_sigterm_drains_through_front_end_and_core_and_exits_0(procs: list) -> None:
    proc, url = start(procs, "--engine-process", "--drain-timeout", "30")
    chunks = stream_with_signal(url, proc, signal.SIGTERM)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # drained, not cut
    assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 20
    assert proc.wait(timeout=60) == 0
    err = proc.stderr.read()
    (core,) = core_pids(err)
    assert "core_proc.stopped" in err and not pid_alive(core)


def test_a_killed_core_makes_the_server_exit_1(procs: list) -> None:
    proc, url = start(procs, "--engine-process")
    with httpx.Client(base_url=url.removesuffix("/v1"), timeout=30) as http:
        assert http.get("/health").status_code == 200
    pid = int(
        subprocess.check_output(
            ["pgrep", "-P", str(proc.pid), "-f", "deltaserve.engine.core.core_proc"]
        ).split()[0]
    )
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == 1
    assert "engine core process" in proc.stderr.read()


@pytest.mark.slow  # three processes load: about 25 s on a 2-core CPU
def test_two_front_ends_share_one_core_and_drain_on_sigterm(procs: list) -> None:
    proc, url = start(procs, "--api-server-count", "2")

    def one(i: int) -> str:
        body = {"prompt": f"Request {i}", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=url, timeout=60) as http:
            r = http.post("/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(32))) == ["length"] * 32
    chunks = stream_with_signal(url, proc, signal.SIGTERM)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=60) == 0
    err = proc.stderr.read()
    (core,) = core_pids(err)
    hellos = [line for line in err.splitlines() if "core_proc.front_end " in line]
    assert len(hellos) == 3  # the supervisor and two front ends
    assert err.count("engine_proc.ready") == 2 and not pid_alive(core)
