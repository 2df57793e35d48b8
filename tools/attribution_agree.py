#!/usr/bin/env python
"""Live engine vs simulator: one workload, one cache, where the missed prompt tokens went.

    python tools/attribution_agree.py                      # chat, 8 x 4 turns, no think time, 12 MiB
    python tools/attribution_agree.py --memory-mb 8 --workload agent --sessions 6
    python tools/attribution_agree.py --json agree.json --tolerance 3

The live side is ``tools/loadgen.py`` against the in-process engine (``--replies recorded``,
so every prompt is the same token list on both sides whatever the model generates). The
simulator side is ``tools/simulate_cache.py`` given the cache the live engine builds at that
budget: the engine's own capacity plan (``EngineCore(config).capacity``: pages, blocks per
page, KV block and state bytes, how many requests run at once) and the step-time model the
live run measured (``scheduler.step_model``), so both replay the workload on the same pools
at about the same pace. Workload flags (``--workload``, ``--sessions``, ``--seed``, ...) go to
both unchanged.

Printed: each cause of ``cache/loss.py`` as a share of the prompt tokens looked up, live and
simulated, and their difference in points; the hit rate likewise. ``preemption`` (recomputed
after a preemption) is outside the sum on both sides and is shown, not compared: the
simulator's clock is virtual, so a request's growth meets another's at other moments than
live. Exit status 1 when a compared row differs by more than ``--tolerance`` points.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from deltaserve.cache.loss import QUERY_CAUSES
from deltaserve.engine.cli import config_from_args
from deltaserve.engine.config import EngineConfig
from deltaserve.logs import configure_logging, get_logger

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
log = get_logger("attribution_agree")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="attribution_agree", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", metavar="FILE", help="engine config (TOML, JSON or YAML), both sides")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    p.add_argument("--memory-mb", type=float, default=12.0, help="the live engine's cache.memory_bytes, MiB")
    p.add_argument("--tolerance", type=float, default=5.0, help="points a compared row may differ by")
    p.add_argument("--json", metavar="FILE", help="write both sides' numbers and the comparison")
    p.add_argument("--log-level", default="warning")
    args, workload = p.parse_known_args(argv)
    args.workload_args = [a for a in workload if a != "--"]
    if not any(a.startswith("--workload") for a in args.workload_args):
        # no think time: which turns overlap then follows the engine's steps, not the wall
        # clock, so the live side does not move with the machine's load
        chat = ["--workload", "chat", "--sessions", "8", "--turns", "4", "--think-time", "0"]
        args.workload_args = [*chat, *args.workload_args]
    return args, args.workload_args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(args, {"cache.memory_bytes": int(args.memory_mb * MiB)})


def live_cache(config: EngineConfig) -> dict[str, Any]:
    """The cache the live engine builds for ``config``: its capacity plan, in the terms the
    simulator takes."""
    from deltaserve.engine.core.engine_core import EngineCore

    core = EngineCore(config)
    try:
        cap = core.capacity
        return {
            "model_path": config.model.path,
            "block_size": cap.block_size,
            "kv_bytes_per_token": cap.kv_block_bytes // cap.block_size,
            "checkpoint_bytes": cap.state_bytes,
            # one budget: pages shared by KV blocks and checkpoints (else the two pools' bytes)
            "cache_bytes": (
                cap.num_pages * cap.page_blocks * cap.kv_block_bytes
                if cap.num_pages
                else cap.num_kv_blocks * cap.kv_block_bytes + cap.num_checkpoint_slots * cap.state_bytes
            ),
            "max_num_seqs": cap.max_num_seqs,
        }
    finally:
        core.close()


def _run(cmd: list[str]) -> None:
    log.info("attribution_agree.run", cmd=" ".join(cmd))
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"attribution_agree: {cmd[1]} exited {proc.returncode}")


def _config_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--config", args.config] if args.config else []
    for item in args.set:
        flags += ["--set", item]
    return flags


def run_live(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """loadgen on the in-process engine; the run's engine counters (warm-up removed)."""
    cmd = [sys.executable, "tools/loadgen.py", *_config_flags(args)]
    cmd += ["--set", f"cache.memory_bytes={int(args.memory_mb * MiB)}", *args.workload_args]
    _run([*cmd, "--replies", "recorded", "--no-progress", "--json", str(out)])
    run = json.loads(out.read_text())["runs"][0]
    stats = run["engine_stats"]
    return {
        "query_tokens": stats["tokens.prompt"],
        "hit_tokens": stats["prefix_cache.hit_tokens"],
        "miss_tokens": {
            k.removeprefix("prefix_cache.miss_tokens."): v
            for k, v in stats.items()
            if k.startswith("prefix_cache.miss_tokens.")
        },
        "step_ms": stats.get("scheduler.step_model.base_ms"),
        "prefill_ms_per_token": (stats.get("scheduler.step_model.prefill_us_per_token") or 0) / 1000,
        "preemptions": stats.get("scheduler.preemptions", 0),
    }


def run_sim(
    args: argparse.Namespace, cache: dict[str, Any], live: dict[str, Any], out: Path
) -> dict[str, Any]:
    """The simulator on the live engine's pools and pace; the ``default`` policy's result."""
    cmd = [sys.executable, "tools/simulate_cache.py", *_config_flags(args)]
    cmd += [
        "--set",
        f"model.path={cache['model_path']}",
        "--set",
        f"scheduler.max_num_seqs={cache['max_num_seqs']}",
    ]
    cmd += ["--memory-mb", repr(cache["cache_bytes"] / MiB)]
    cmd += ["--kv-bytes-per-token", str(cache["kv_bytes_per_token"])]
    cmd += ["--checkpoint-bytes", str(cache["checkpoint_bytes"])]
    if live["step_ms"]:
        cmd += ["--step-ms", repr(live["step_ms"]), "--ms-per-token", repr(live["prefill_ms_per_token"])]
    _run([*cmd, *args.workload_args, "--replies", "recorded", "--policies", "default", "--json", str(out)])
    data = json.loads(out.read_text())
    (result,) = [r for w in data["workloads"].values() for r in w["results"] if r["policy"] == "default"]
    return {
        "query_tokens": result["query_tokens"],
        "hit_tokens": result["query_hit_tokens"],
        "miss_tokens": result["miss_tokens"],
        "preemptions": result["preemptions"],
    }


def compare(live: dict[str, Any], sim: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per cause present on either side (``hit`` first, ``preemption`` last and not
    compared): percentages of each side's looked-up prompt tokens and the difference."""

    def pct(side: dict[str, Any], key: str) -> float:
        n = side["hit_tokens"] if key == "hit" else side["miss_tokens"].get(key, 0)
        return 100.0 * n / side["query_tokens"] if side["query_tokens"] else 0.0

    rows = []
    for key in ("hit", *QUERY_CAUSES, "preemption"):
        a, b = pct(live, key), pct(sim, key)
        if key in ("hit", "cold") or a or b:
            rows.append({"row": key, "live": a, "sim": b, "diff": b - a, "compared": key != "preemption"})
    return rows


def render(
    rows: list[dict[str, Any]], cache: dict[str, Any], live: dict[str, Any], sim: dict[str, Any]
) -> str:
    lines = [
        f"cache: {cache['cache_bytes'] / MiB:.2f} MiB of pages, {cache['kv_bytes_per_token']} B KV/token, "
        f"{cache['checkpoint_bytes'] / MiB:.2f} MiB/checkpoint, {cache['max_num_seqs']} running at most; "
        f"preemptions live {live['preemptions']}, sim {sim['preemptions']}",
        "% of prompt tokens looked up      live    sim   sim - live",
    ]
    for r in rows:
        mark = "" if r["compared"] else "   (not compared)"
        lines.append(f"  {r['row']:<30} {r['live']:6.1f} {r['sim']:6.1f} {r['diff']:+8.1f}{mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, _ = parse_args(argv)
    configure_logging(args.log_level)
    cache = live_cache(engine_config(args))
    with tempfile.TemporaryDirectory(prefix="attribution-agree-") as tmp:
        live = run_live(args, Path(tmp) / "live.json")
        sim = run_sim(args, cache, live, Path(tmp) / "sim.json")
    rows = compare(live, sim)
    worst = max(abs(r["diff"]) for r in rows if r["compared"])
    print(render(rows, cache, live, sim))
    print(f"largest difference: {worst:.1f} points (tolerance {args.tolerance:g})")
    if args.json:
        doc = {"tool": "attribution_agree", "argv": sys.argv[1:], "cache": cache, "live": live, "sim": sim}
        Path(args.json).write_text(json.dumps({**doc, "rows": rows, "largest_difference": worst}, indent=1))
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    raise SystemExit(run_tool(main, "attribution_agree"))
