#!/usr/bin/env python
"""The engine core in its own process vs in the server's, measured with ``tools/loadgen.py``.

    python tools/bench/bench_engine_proc.py [--modes in_process separate api2] [--concurrency 1 16 64]
                                      [--seeds 0] [--rounds 1] [--json out.json]

For each mode a ``deltaserve serve`` is started (``separate``: the default server;
``in_process``: ``--in-process``; ``api2``: ``--api-server-count 2``), all of them before the
first run. Per concurrency and seed, the in-process engine (``loadgen --backend engine``) and
every server (``loadgen --backend openai``) run as interleaved rounds (``harness.interleaved``:
engine, servers, then reversed; random workload, 128-token prompts, 64 output tokens, the
built-in model; requests: 8 at concurrency 1, else 3 x concurrency), so load from elsewhere
hits every side alike. Each mode's row: its median output tokens/s divided by the engine's
(and the min-max of both), and the TTFT p50 the server adds (medians). The CPU time
(``/proc/PID/stat``) the server process (in-process) or the core process (separate) spends
per streamed token, and the front end's, is read around each server run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, interleaved, spread

ENGINE = ["--set", "scheduler.max_num_seqs=128", "--set", "logging.stats_interval_s=0"]
MODE_FLAGS = {"in_process": ["--in-process"], "separate": [], "api2": ["--api-server-count", "2"]}


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        out = subprocess.check_output(["pgrep", "-P", str(pid)], text=True)
    except subprocess.CalledProcessError:
        return []
    return [int(x) for x in out.split()]


def core_pid(server: int) -> int | None:
    for pid in [server, *children(server)]:
        for child in children(pid):
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"deltaserve.engine.core.core_proc" in f.read():
                    return child
    return None


def start_server(mode: str) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "deltaserve", "serve", "--host", "127.0.0.1", "--port", "0",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd + ENGINE + MODE_FLAGS[mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    if " at " not in first:
        raise RuntimeError(f"server did not start: {first!r}")
    return proc, first.split(" at ")[1].split()[0]


def loadgen_summary(concurrency: int, seed: int, backend: list[str]) -> dict[str, Any]:
    """One ``tools/loadgen.py`` run of the benchmark's workload on ``backend``: its summary."""
    n = 8 if concurrency == 1 else 3 * concurrency
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "tools/loadgen.py", "--workload", "random", "--prompt-len", "128", "--output-len", "64",
           "--num-requests", str(n), "--concurrency", str(concurrency), "--seed", str(seed), "--backend", *backend,
           "--json", out, "--no-progress", "--log-level", "warning", *ENGINE]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        doc = json.load(f)
    os.unlink(out)
    return doc["runs"][0]["summary"]


class Server:
    """A running ``deltaserve serve`` of one mode, and the processes whose CPU time is read."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.proc, self.url = start_server(mode)
        self.core = core_pid(self.proc.pid)
        self.fronts = (
            [self.proc.pid] if mode != "api2" else [p for p in children(self.proc.pid) if p != self.core]
        )

    def cpu(self) -> tuple[float, float]:
        """(core, front end) CPU seconds so far."""
        return (cpu_s(self.core) if self.core else 0.0), sum(cpu_s(p) for p in self.fronts)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def measure(servers: list[Server], concurrency: int, seed: int, rounds: int) -> list[dict[str, Any]]:
    """The engine and every server as interleaved rounds at one concurrency and seed; a row per mode."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)

    def engine() -> float:
        summary = loadgen_summary(concurrency, seed, ["engine"])
        runs["engine"].append({"ttft_ms": 1000 * summary["ttft_s"]["p50"]})
        return summary["output_throughput"]

    def server(srv: Server) -> Callable[[], float]:
        def run() -> float:
            core0, front0 = srv.cpu()
            summary = loadgen_summary(concurrency, seed, ["openai", "--base-url", srv.url])
            core1, front1 = srv.cpu()
            tokens = summary["output_tokens"]
            runs[srv.mode].append({
                "ttft_ms": 1000 * summary["ttft_s"]["p50"],
                "core_cpu_us_per_token": 1e6 * (core1 - core0) / tokens if srv.core else None,
                "front_cpu_us_per_token": 1e6 * (front1 - front0) / tokens,
            })  # fmt: skip
            return summary["output_throughput"]

        return run

    tok_s = interleaved({"engine": engine, **{srv.mode: server(srv) for srv in servers}}, rounds)
    engine_tok, engine_ttft = spread(tok_s["engine"]), statistics.median(r["ttft_ms"] for r in runs["engine"])
    rows = []
    for srv in servers:
        rs = runs[srv.mode]
        core = [r["core_cpu_us_per_token"] for r in rs if r["core_cpu_us_per_token"] is not None]
        server_tok = spread(tok_s[srv.mode])
        row = {
            "mode": srv.mode,
            "concurrency": concurrency,
            "seed": seed,
            "ratio": server_tok["median"] / engine_tok["median"],
            "engine_tok_s": engine_tok,
            "server_tok_s": server_tok,
            "ttft_added_ms": statistics.median(r["ttft_ms"] for r in rs) - engine_ttft,
            "core_cpu_us_per_token": statistics.median(core) if core else None,
            "front_cpu_us_per_token": statistics.median(r["front_cpu_us_per_token"] for r in rs),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = bench_parser(__doc__, rounds=1)
    ap.add_argument("--modes", nargs="+", default=list(MODE_FLAGS), choices=list(MODE_FLAGS))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    args = ap.parse_args()
    bench = Bench("bench_engine_proc", args)
    rows = []
    t0 = time.monotonic()
    servers: list[Server] = []
    try:
        for mode in args.modes:
            servers.append(Server(mode))
        for c in args.concurrency:
            for seed in args.seeds:
                rows += measure(servers, c, seed, args.rounds)
    finally:
        for srv in servers:
            srv.stop()
    print(
        f"\n{'mode':<11}{'conc':>5}{'runs':>5}{'ratio med':>10}{'ttft+ ms':>9}{'core us/tok':>12}{'front us/tok':>13}"
    )
    for mode in args.modes:
        for c in args.concurrency:
            rs = [r for r in rows if r["mode"] == mode and r["concurrency"] == c]
            core = [r["core_cpu_us_per_token"] for r in rs if r["core_cpu_us_per_token"] is not None]
            print(
                f"{mode:<11}{c:>5}{len(rs) * args.rounds:>5}{statistics.median(r['ratio'] for r in rs):>10.3f}"
                f"{statistics.median(r['ttft_added_ms'] for r in rs):>9.1f}"
                f"{statistics.median(core) if core else float('nan'):>12.0f}"
                f"{statistics.median(r['front_cpu_us_per_token'] for r in rs):>13.0f}"
            )
    print(f"({time.monotonic() - t0:.0f} s; engine and servers interleaved, {args.rounds} round(s) each)")
    print(describe_box(bench.before))
    bench.write(args.json, rows)


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "bench_engine_proc")
