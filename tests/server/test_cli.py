"""``python -m deltaserve serve`` as a user runs it: URL and capacity on stdout, requests served,
SIGINT drains the in-flight stream and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from deltaserve.server.cli import build_parser


def test_parser_has_the_serve_command() -> None:
    args = build_parser().parse_args(
        ["serve", "--port", "0", "--set", "scheduler.policy=lpm", "--served-model-name", "m"]
    )
    assert args.command == "serve" and args.port == 0 and args.set == ["scheduler.policy=lpm"]
    assert args.served_model_name == ["m"] and args.host == "0.0.0.0"  # vLLM's default


def test_serve_drains_on_sigint_and_exits_0() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "deltaserve", "serve", "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
           "--set", "cache.memory_bytes=67108864", "--set", "logging.stats_interval_s=60", "--drain-timeout", "30"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # blocks until the model is loaded (or the process died)
        assert first.startswith("deltaserve: serving builtin:tiny-qwen3.5 at http://127.0.0.1:"), first + (
            proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
        )
        url = first.split(" at ")[1].split()[0]
        capacity = proc.stdout.readline()
        assert capacity.startswith("deltaserve: capacity ") and "kv_tokens=" in capacity
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/models").json()["data"][0]["id"] == "builtin:tiny-qwen3.5"
            body = {"prompt": "Hello", "max_tokens": 24, "ignore_eos": True, "stream": True}
            frames: list[str] = []
            with http.stream("POST", "/completions", json=body) as resp:
                lines = resp.iter_lines()
                frames.append(next(lines))
                # a signal while the stream is in flight: it is drained, not cut
                threading.Timer(0.05, proc.send_signal, (signal.SIGINT,)).start()
                frames += list(lines)
        data = [f[6:] for f in frames if f.startswith("data: ")]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        assert "deltaserve: stopped" in proc.stdout.read()
        time.sleep(0)  # nothing else listens any more
        with httpx.Client(timeout=2) as http:
            try:
                http.get(url + "/models")
                raise AssertionError("server still answers after exit")
            except httpx.TransportError:
                pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
