"""``deltaserve serve`` stops cleanly: after a structured-output request (so xgrammar's compiler,
compiled grammars and matchers exist), SIGTERM or SIGINT ends it with exit status 0 and nothing
on stderr from interpreter teardown: no "nanobind: leaked ..." dump (native objects alive when
their modules are torn down: the core process's frozen startup objects, the grammar caches) and
no traceback. Also a server that cannot bind its port leaves no dump."""

from __future__ import annotations

import signal
import socket
import subprocess

import httpx
import pytest

from tests.serve_procs import popen_serve

SETTINGS = ["--set", "cache.memory_bytes=64MiB", "--set", "logging.stats_interval_s=60",
            "--set", "scheduler.max_num_seqs=8"]  # fmt: skip
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def serve(procs: list[subprocess.Popen[str]], *extra: str) -> subprocess.Popen[str]:
    return popen_serve(procs, "--log-level", "info", *SETTINGS, *extra)


def teardown_noise(stderr: str) -> list[str]:
    return [
        line for line in stderr.splitlines() if "nanobind" in line or "Traceback" in line or "leaked" in line
    ]


@pytest.mark.parametrize(
    ("placement", "sig"),
    [
        ("separate", signal.SIGTERM),
        # the other signal and the in-process placement (which never leaked) in the slow run
        pytest.param("separate", signal.SIGINT, marks=pytest.mark.slow),
        pytest.param("in_process", signal.SIGTERM, marks=pytest.mark.slow),
        pytest.param("in_process", signal.SIGINT, marks=pytest.mark.slow),
    ],
)
def test_serve_exits_0_without_a_nanobind_dump(
    procs: list[subprocess.Popen[str]], placement: str, sig: signal.Signals
) -> None:
    proc = serve(procs, "--port", "0", "--set", f"engine.core_process={placement}")
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    assert " at http://127.0.0.1:" in first, first + (proc.stderr.read() if proc.poll() is not None else "")
    url = first.split(" at ")[1].split()[0]
    body = {
        "messages": [{"role": "user", "content": "a number"}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    }
    with httpx.Client(base_url=url, timeout=120) as http:
        assert http.post("/chat/completions", json=body).status_code == 200
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 0
    stderr = proc.stderr.read()
    assert teardown_noise(stderr) == [], stderr[-4000:]
    if placement == "separate":
        assert "core_proc.stopped" in stderr  # the core process ran its teardown too


def test_a_port_in_use_leaves_no_nanobind_dump(procs: list[subprocess.Popen[str]]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = serve(procs, "--port", str(taken.getsockname()[1]))
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert teardown_noise(stderr) == [], stderr[-4000:]
    assert "in use" in stderr
