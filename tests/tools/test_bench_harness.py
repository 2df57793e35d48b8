"""tools/bench/harness.py: interleaved rounds in alternating order, medians with their spread,
the other busy processes read from /proc, and the one JSON shape."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from deltaserve.tools.bench import harness


def test_spread_is_the_median_with_min_max_and_quartiles() -> None:
    assert harness.spread([5.0, 1.0, 3.0, 2.0, 4.0]) == {
        "median": 3.0, "min": 1.0, "max": 5.0, "q1": 2.0, "q3": 4.0, "n": 5
    }  # fmt: skip
    assert harness.spread([7.0]) == {"median": 7.0, "min": 7.0, "max": 7.0, "q1": 7.0, "q3": 7.0, "n": 1}
    assert harness.scaled(harness.spread([0.001, 0.003]), 1000) == {
        "median": 2.0, "min": 1.0, "max": 3.0, "q1": 1.5, "q3": 2.5, "n": 2
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"^spread\(\) of no values$"):
        harness.spread([])


def test_interleaved_alternates_the_order_and_drops_the_warmup() -> None:
    calls: list[str] = []

    def case(name: str, value: float | None) -> Callable[[], float | None]:
        def run() -> float | None:
            calls.append(name)
            return value

        return run

    out = harness.interleaved({"a": case("a", 2.5), "b": case("b", None)}, 3, warmup=1)
    # warm-up round a b, then b a, a b, b a: neither side always runs first
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert out["a"] == [2.5, 2.5, 2.5]  # a case's own number is its measure
    assert len(out["b"]) == 3 and all(0 <= t < 1 for t in out["b"])  # else its wall seconds
    with pytest.raises(ValueError, match=r"^rounds must be >= 1, got 0$"):
        harness.interleaved({"a": case("a", None)}, 0)


def test_interleaved_async_runs_the_same_order() -> None:
    calls: list[str] = []

    def case(name: str) -> Callable[[], Awaitable[float]]:
        async def run() -> float:
            calls.append(name)
            await asyncio.sleep(0)
            return float(len(calls))

        return run

    out = asyncio.run(harness.interleaved_async({"a": case("a"), "b": case("b")}, 2))
    assert calls == ["a", "b", "b", "a"] and out == {"a": [1.0, 4.0], "b": [2.0, 3.0]}


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
def test_box_lists_another_busy_process_and_never_this_one() -> None:
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = harness.busy_processes(sample_s=1.0)
    finally:
        spin.kill()
        spin.wait()
    pids = {p["pid"]: p for p in busy}
    # a spinning process gets a good share of a core even on a loaded box
    assert spin.pid in pids and pids[spin.pid]["cpu_pct"] >= harness.BUSY_PCT
    assert pids[spin.pid]["name"].startswith("python")
    assert os.getpid() not in pids
    box = harness.box()
    assert box["cpus"] == os.cpu_count() and len(box["loadavg"]) == 3
    assert harness.describe_box(box).startswith(f"box: {os.cpu_count()} CPUs, load ")


def test_bench_writes_the_one_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(reps=3, json=tmp_path / "out.json", out=tmp_path)
    bench = harness.Bench("bench_x", args)
    doc = bench.write(args.json, [{"case": "a", "seconds": harness.spread([1.0, 2.0])}])
    assert capsys.readouterr().out == f"wrote {args.json}\n"
    saved = json.loads(args.json.read_text())
    assert saved == doc
    assert saved["tool"] == "bench_x"
    assert saved["args"] == {"reps": 3, "json": str(args.json), "out": str(tmp_path)}
    assert set(saved["box"]) == {"before", "after"}
    assert set(saved["box"]["after"]) == {"cpus", "loadavg", "torch_threads", "busy"}
    assert saved["results"][0]["seconds"]["median"] == 1.5
    assert harness.Bench("bench_x").write(None, 1)["results"] == 1  # no path: nothing written
    assert capsys.readouterr().out == ""


def test_bench_parser_takes_json_and_rounds() -> None:
    args = harness.bench_parser("doc", rounds=3).parse_args(["--json", "out.json"])
    assert args.json == Path("out.json") and args.rounds == 3
    plain = harness.bench_parser("doc").parse_args([])
    assert plain.json is None and not hasattr(plain, "rounds")
