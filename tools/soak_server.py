"""A bounded soak of ``deltaserve serve``: mixed good and bad traffic for ``--duration``
seconds against a server on 127.0.0.1, with the RSS and open file descriptors of every process
it runs (the server, its front ends and its engine core process: ``--engine-process``,
``--api-server-count N``; extra ``serve`` flags after ``--``), running requests and 5xx count
sampled every ``--every`` seconds.

Traffic (``--workers`` loops, each picking at random): streaming chats read to the end, streams
left after two chunks (a disconnect), ``n = 2`` completions with stop strings, and bad bodies
(malformed JSON, not UTF-8, nested too deep, a wrong type, a body over the limit). At the end
the server must have answered no 5xx, its running requests must be back to 0, and RSS and file
descriptors must be flat (last sample against the first after warm-up).

    python tools/soak_server.py [--duration 600] [--workers 8] [--json soak.json] [-- --engine-process]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from typing import Any

import httpx

from deltaserve.logs import configure_logging, get_logger

log = get_logger("deltaserve.tools.soak")

CHAT = "/v1/chat/completions"
BAD_BODIES = [
    b'{"messages": [',
    b'{"messages": [{"role": "user", "content": "a\xff\xfe"}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
    + b"[" * 3000
    + b"]" * 3000
    + b"}}",
    b'{"messages": "not a list"}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": -3}',
]


def start_server(extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "deltaserve", "serve", "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
           "--set", "logging.stats_interval_s=0", "--max-body-bytes", "2000000", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    if " at " not in first:
        proc.kill()
        raise RuntimeError(f"the server did not start: {first!r}")
    return proc, first.split(" at ")[1].split()[0].removesuffix("/v1")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the server's front ends and engine core process)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue  # gone meanwhile
    return out


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            found = re.search(r"VmRSS:\s+(\d+)", f.read())
        return int(found.group(1)) if found else 0
    except OSError:
        return 0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def sample(pid: int, metrics: str) -> dict[str, float]:
    """The server's numbers now; RSS and descriptors summed over its process tree."""
    procs = process_tree(pid)

    def value(pattern: str) -> float:
        # any labels after the pattern (every series has model_name)
        return sum(float(v) for v in re.findall(rf"^{pattern}(?:\{{[^}}]*\}})? (\S+)$", metrics, re.M))

    return {
        "processes": len(procs),
        "rss_mb": sum(_rss_kb(p) for p in procs) / 1024,
        "fds": sum(_fds(p) for p in procs),
        "running": value(r"deltaserve:num_requests_running"),
        "waiting": value(r"deltaserve:num_requests_waiting"),
        "errors_5xx": value(r'deltaserve:http_errors_total\{[^}]*status="5\d\d"\}'),
        "disconnects": value(r"deltaserve:client_disconnects_total"),
    }


async def one(http: httpx.AsyncClient, rng: random.Random, counts: dict[str, int]) -> None:
    kind = rng.choice(["stream", "stream", "leave", "n2", "bad", "big"])
    messages = [{"role": "user", "content": f"soak {rng.random()}"}]
    if kind in ("stream", "leave"):
        body = {"messages": messages, "max_tokens": rng.randint(8, 32), "stream": True, "ignore_eos": True}
        async with http.stream("POST", CHAT, json=body) as r:
            seen = 0
            async for _ in r.aiter_lines():
                seen += 1
                if kind == "leave" and seen >= 2:
                    break
    elif kind == "n2":
        body = {"prompt": f"soak {rng.random()}", "n": 2, "max_tokens": 16, "stop": ["e", "\n"]}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text[:200]
    elif kind == "bad":
        r = await http.post(
            CHAT, content=rng.choice(BAD_BODIES), headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, (r.status_code, r.text[:200])
    else:
        r = await http.post(
            CHAT, content=b"{" + b" " * 2_100_000 + b"}", headers={"content-type": "application/json"}
        )
        assert r.status_code == 413, r.status_code
    counts[kind] = counts.get(kind, 0) + 1


async def soak(url: str, pid: int, duration: float, workers: int, every: float) -> dict[str, Any]:
    counts: dict[str, int] = {}
    samples: list[dict[str, float]] = []
    deadline = time.monotonic() + duration

    async def worker(i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while time.monotonic() < deadline:
                await one(http, rng, counts)

    async with httpx.AsyncClient(base_url=url, timeout=30) as probe:
        tasks = [asyncio.ensure_future(worker(i)) for i in range(workers)]
        t0 = time.monotonic()
        while not all(t.done() for t in tasks):
            await asyncio.sleep(every)
            s = sample(pid, (await probe.get("/metrics")).text)
            s["t"] = round(time.monotonic() - t0, 1)
            samples.append(s)
            log.info("soak.sample", **s, requests=sum(counts.values()))
        await asyncio.gather(*tasks)  # a worker's failed assertion surfaces here
        for _ in range(60):  # aborted streams end at the next step boundary
            end = sample(pid, (await probe.get("/metrics")).text)
            if end["running"] == 0 and end["waiting"] == 0:
                break
            await asyncio.sleep(0.5)
    return {"counts": counts, "samples": samples, "end": end}


def verdict(result: dict[str, Any]) -> list[str]:
    """What is wrong with a soak's result (empty: it passed)."""
    samples, end = result["samples"], result["end"]
    base = samples[min(2, len(samples) - 1)]  # after warm-up (the model's first shapes)
    problems = []
    if end["errors_5xx"]:
        problems.append(f"{end['errors_5xx']:.0f} responses were 5xx")
    if end["running"] or end["waiting"]:
        problems.append(f"requests left: running {end['running']:.0f}, waiting {end['waiting']:.0f}")
    if end["rss_mb"] > base["rss_mb"] * 1.15 + 20:
        problems.append(f"RSS grew {base['rss_mb']:.0f} -> {end['rss_mb']:.0f} MB")
    if end["processes"] != base["processes"]:
        problems.append(f"the server ran {base['processes']:.0f} processes, then {end['processes']:.0f}")
    if end["fds"] > base["fds"] + 16:
        problems.append(f"open file descriptors grew {base['fds']:.0f} -> {end['fds']:.0f}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("serve_args", nargs="*", help="extra deltaserve serve flags (after --)")
    args = parser.parse_args(argv)
    configure_logging("info")
    proc, url = start_server(args.serve_args)
    try:
        result = asyncio.run(soak(url, proc.pid, args.duration, args.workers, args.every))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result["problems"] = verdict(result)
    first, last = result["samples"][0], result["end"]
    print(f"requests {sum(result['counts'].values())} {result['counts']}")
    print(f"RSS {first['rss_mb']:.0f} -> {last['rss_mb']:.0f} MB, fds {first['fds']:.0f} -> {last['fds']:.0f}, "
          f"running at the end {last['running']:.0f}, 5xx {last['errors_5xx']:.0f}, "
          f"disconnects {last['disconnects']:.0f}")  # fmt: skip
    print("ok" if not result["problems"] else "PROBLEMS: " + "; ".join(result["problems"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
