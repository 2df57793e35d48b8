"""Resident memory of an engine across runs of a workload, against the memory it plans for.

Starts one in-process engine (``AsyncEngine`` over an ``EngineCore``) on the configured model,
then runs the same workload ``--runs`` times through it (``tools/live.py``, as loadgen does).
Prints, on stdout, the process's resident memory after start-up and after each run (total,
anonymous, file-backed, peak), next to the capacity line's ``expected_rss_mib`` (weights + cache
pools + one step's activations + a fixed overhead) and their ratio; progress goes to stderr.

    python tools/bench/bench_rss.py                                    # built-in model, 256 MiB cache
    python tools/bench/bench_rss.py --model /work/scratch/q08 --set cache.memory_bytes=4294967296 \\
        --sessions 4 --turns 3 --prefix-len 400 --prompt-len 64 --output-len 16 --concurrency 4
    python tools/bench/bench_rss.py --set engine.release_memory=false  # without giving memory back

Exit status 1 when ``--check`` is given and a measurement exceeds the expected resident memory.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from deltaserve.engine.runner.memory import Resident, resident
from deltaserve.logs import configure_logging, get_logger
from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box

log = get_logger("deltaserve.bench_rss")

MiB = 1024**2
DEFAULT_BUDGET = 256 * MiB


def build_parser() -> argparse.ArgumentParser:
    from deltaserve.engine.cli import add_config_args
    from deltaserve.tools.workloads import add_workload_args

    ap = bench_parser(__doc__, prog="bench_rss")
    add_config_args(ap)
    add_workload_args(ap)
    ap.add_argument("--model", metavar="PATH", help="model folder (sets model.path; default the config's)")
    ap.add_argument("--runs", type=int, default=2, help="runs of the workload (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests per run (default %(default)s)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a measurement exceeds the expected RSS")
    ap.add_argument("--log-level", default="info")
    return ap


def make_config(args: argparse.Namespace) -> Any:
    """The engine config of ``--config``/``--set`` and ``--model``; without ``--config``, a
    ``DEFAULT_BUDGET`` cache unless ``--set cache.memory_bytes=`` says otherwise."""
    from deltaserve.engine.cli import config_from_args

    if args.model:
        args.set = [*args.set, f"model.path={args.model}"]
    base = None if args.config else {"cache.memory_bytes": DEFAULT_BUDGET}
    return config_from_args(args, base)


def row(label: str, now: Resident, expected: int, seconds: float | None = None) -> dict[str, Any]:
    """One line of the table: the measurement, the expected resident memory and their ratio."""
    out: dict[str, Any] = {"when": label, **now.mib(), "expected_rss_mib": round(expected / MiB, 1)}
    out["ratio"] = round(now.total / expected, 3) if expected else None
    if seconds is not None:
        out["run_s"] = round(seconds, 1)
    return out


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as an aligned text table."""
    cols = [
        "when",
        "rss_mib",
        "rss_anon_mib",
        "rss_file_mib",
        "rss_peak_mib",
        "expected_rss_mib",
        "ratio",
        "run_s",
    ]
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(lines)


def _measure() -> Resident:
    now = resident()
    if now is None:
        raise SystemExit("bench_rss: no /proc/self/status here (Linux only)")
    return now


async def run_all(args: argparse.Namespace, core: Any) -> list[dict[str, Any]]:
    """The start-up row, then one row after each run of the workload."""
    from deltaserve.tools.backends import EngineBackend, Sampling
    from deltaserve.tools.live import run_live
    from deltaserve.tools.workloads import (
        HFCodec,
        arrival_from_args,
        make_workload,
        params_from_args,
        plan_arrivals,
    )

    expected = core.capacity.expected_resident_bytes
    rows = [row("start", _measure(), expected)]
    log.info("bench_rss.measured", **rows[-1])
    params = params_from_args(args, block_size=core.config.cache.block_size)
    workload = make_workload(params, HFCodec(core.tokenizer))
    plan = plan_arrivals(workload.roots(), arrival_from_args(args), args.seed)
    for i in range(args.runs):
        started = time.perf_counter()
        backend = EngineBackend(core, Sampling(0.0, 1.0, True, None))
        await run_live(backend, workload, plan, label=f"run{i + 1}", progress=False, warmup=args.warmup)
        rows.append(row(f"run{i + 1}", _measure(), expected, time.perf_counter() - started))
        log.info("bench_rss.measured", **rows[-1])
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    bench = Bench("bench_rss", args)
    from deltaserve.engine import EngineCore

    core = EngineCore(make_config(args))
    log.info("bench_rss.capacity", **core.capacity.describe())
    rows = asyncio.run(run_all(args, core))
    print(format_rows(rows))
    print(describe_box(bench.before))
    bench.write(args.json, {"capacity": core.capacity.describe(), "rows": rows})
    over = [r["when"] for r in rows if r["ratio"] is not None and r["ratio"] > 1.0]
    if args.check and over:
        print(f"over the expected resident memory: {', '.join(over)}", file=sys.stderr)
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "bench_rss")
