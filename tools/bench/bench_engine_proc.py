#!/usr/bin/env python
"""The engine core in its own process vs in the server's, measured with ``tools/loadgen.py``.

    python tools/bench/bench_engine_proc.py [--modes in_process separate api2] [--concurrency 1 16 64]
                                      [--seeds 0] [--json out.json]

For each mode a ``deltaserve serve`` is started (``separate``: the default server;
``in_process``: ``--in-process``; ``api2``: ``--api-server-count 2``) and, per concurrency and
seed, one ``loadgen --backend engine openai`` run (random workload, 128-token prompts, 64 output
tokens, the built-in model; requests: 8 at concurrency 1, else 3 x concurrency) gives the
server's output tokens/s divided by the in-process engine's of the same run, and the TTFT p50
the server adds. The CPU time (``/proc/PID/stat``) the server process (in-process) or the core
process (separate) spends per streamed token, and the front end's, is read around each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

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


def one_run(url: str, concurrency: int, seed: int) -> dict[str, Any]:
    n = 8 if concurrency == 1 else 3 * concurrency
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "tools/loadgen.py", "--workload", "random", "--prompt-len", "128", "--output-len", "64",
           "--num-requests", str(n), "--concurrency", str(concurrency), "--seed", str(seed), "--backend", "engine",
           "openai", "--base-url", url, "--json", out, "--no-progress", "--log-level", "warning", *ENGINE]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        doc = json.load(f)
    os.unlink(out)
    engine, server = (r["summary"] for r in doc["runs"])
    return {
        "ratio": server["output_throughput"] / engine["output_throughput"],
        "engine_tok_s": engine["output_throughput"],
        "server_tok_s": server["output_throughput"],
        "ttft_added_ms": 1000 * (server["ttft_s"]["p50"] - engine["ttft_s"]["p50"]),
        "tokens": server["output_tokens"],
    }


def bench_mode(mode: str, concurrencies: list[int], seeds: list[int]) -> list[dict[str, Any]]:
    proc, url = start_server(mode)
    rows = []
    try:
        core = core_pid(proc.pid)
        fronts = [proc.pid] if mode != "api2" else [p for p in children(proc.pid) if p != core]
        for c in concurrencies:
            for seed in seeds:
                core_before = cpu_s(core) if core else 0.0
                front_before = sum(cpu_s(p) for p in fronts)
                r = one_run(url, c, seed)
                r["core_cpu_us_per_token"] = 1e6 * (cpu_s(core) - core_before) / r["tokens"] if core else None
                r["front_cpu_us_per_token"] = (
                    1e6 * (sum(cpu_s(p) for p in fronts) - front_before) / r["tokens"]
                )
                r.update(mode=mode, concurrency=c, seed=seed)
                rows.append(r)
                print(json.dumps(r), flush=True)
    finally:
        proc.terminate()
        proc.wait(120)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODE_FLAGS), choices=list(MODE_FLAGS))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    rows = []
    t0 = time.monotonic()
    for mode in args.modes:
        rows += bench_mode(mode, args.concurrency, args.seeds)
    print(
        f"\n{'mode':<11}{'conc':>5}{'runs':>5}{'ratio med':>10}{'ttft+ ms':>9}{'core us/tok':>12}{'front us/tok':>13}"
    )
    for mode in args.modes:
        for c in args.concurrency:
            rs = [r for r in rows if r["mode"] == mode and r["concurrency"] == c]
            core = [r["core_cpu_us_per_token"] for r in rs if r["core_cpu_us_per_token"] is not None]
            print(
                f"{mode:<11}{c:>5}{len(rs):>5}{statistics.median(r['ratio'] for r in rs):>10.3f}"
                f"{statistics.median(r['ttft_added_ms'] for r in rs):>9.1f}"
                f"{statistics.median(core) if core else float('nan'):>12.0f}"
                f"{statistics.median(r['front_cpu_us_per_token'] for r in rs):>13.0f}"
            )
    print(f"({time.monotonic() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "bench_engine_proc")
