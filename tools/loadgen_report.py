"""What loadgen prints, writes and draws: the workload line, the columns' agreement, the JSON
document (every record, summaries, ratios to the first column) and the plot."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deltaserve.tools.live import RunResult
from deltaserve.tools.workloads import Workload


def workload_line(workload: Workload, plan: dict[str, Any]) -> str:
    p = workload.describe()
    keys = ("sessions", "turns", "num_requests", "prefix_len", "prompt_len", "output_len", "tool_len",
            "num_prefixes", "suffixes_per_prefix", "branches", "think_time")  # fmt: skip
    parts = [
        f"{k}={p[k]}" for k in keys if p.get(k) is not None and (k != "think_time" or workload.multi_turn)
    ]
    arr = plan["mode"] + (f" rate={plan['rate']}/s" if plan.get("rate") else "")
    arr += f" concurrency={plan['concurrency']}" if plan.get("concurrency") else ""
    return f"workload {workload.name} ({', '.join(parts)}; {p['expected_requests']} requests; {arr}; seed={workload.seed})"


def agreement_rows(runs: Sequence[RunResult]) -> list[tuple[str, list[str]]]:
    """Did every column send the same prompts and get the same outputs as the first?"""
    if len(runs) < 2:
        return []
    first_p = {r.rid: r.prompt_hash for r in runs[0].records}
    first_o = {r.rid: r.output_token_ids for r in runs[0].records}
    prompts, outputs = ["ref"], ["ref"]
    for run in runs[1:]:
        same_p = sum(1 for r in run.records if first_p.get(r.rid) == r.prompt_hash)
        same_o = sum(1 for r in run.records if first_o.get(r.rid) == r.output_token_ids)
        prompts.append(f"{same_p}/{len(run.records)}")
        outputs.append(f"{same_o}/{len(run.records)}")
    return [("same prompts as first", prompts), ("same outputs as first", outputs)]


def _clean(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _ratios(runs: Sequence[RunResult]) -> dict[str, dict[str, float | None]]:
    """Each column's throughputs and latency quantiles over the first column's."""
    first = runs[0].summary
    ratios = {}
    for run in runs[1:]:
        ratios[run.label] = {
            k: (run.summary[k] / first[k] if isinstance(first.get(k), (int, float)) and first[k] else None)
            for k in ("request_throughput", "output_throughput", "total_throughput")
        } | {
            f"{k}.{q}": (
                run.summary[k][q] / first[k][q] if first[k][q] and not math.isnan(first[k][q]) else None
            )
            for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")
            for q in ("mean", "p50", "p90", "p99")
        }
    return ratios


def _run_entry(run: RunResult) -> dict[str, Any]:
    return {
        "label": run.label,
        "backend": run.backend["kind"],
        "model": run.backend.get("model"),
        "config": run.backend.get("config", {k: v for k, v in run.backend.items() if k != "kind"}),
        "wall_s": run.wall_s,
        "summary": run.summary,
        "engine_stats": run.engine_stats,
        "engine_stats_total": run.engine_stats_total,
        "records": [r.to_dict() for r in run.records],
    }


def write_json(path: str, args: argparse.Namespace, workload: Workload, runs: Sequence[RunResult]) -> None:
    doc = {
        "tool": "deltaserve.loadgen",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": sys.argv[1:] if args.argv is None else args.argv,
        "workload": {"name": workload.name, "params": workload.describe()},
        "arrivals": runs[0].arrivals,
        "runs": [_run_entry(run) for run in runs],
        "comparison": {
            "reference": runs[0].label,
            "ratios": _ratios(runs),
            "agreement": dict(agreement_rows(runs)),
        },
    }
    Path(path).write_text(json.dumps(_clean(doc), indent=1))


def _latency_cdfs(axes: Sequence[Any], runs: Sequence[RunResult]) -> None:
    from deltaserve.tools.metrics import e2e, itls, tpot, ttft

    panels = [
        ("TTFT (ms)", lambda rs: [ttft(r) for r in rs]),
        ("TPOT (ms)", lambda rs: [tpot(r) for r in rs]),
        ("inter-token latency (ms)", lambda rs: [x for r in rs for x in itls(r)]),
        ("end-to-end latency (ms)", lambda rs: [e2e(r) for r in rs]),
    ]
    for ax, (name, get) in zip(axes, panels, strict=False):
        for run in runs:
            xs = sorted(1000 * x for x in get([r for r in run.records if r.ok]) if x is not None)
            if xs:
                ax.plot(
                    xs, [(i + 1) / len(xs) for i in range(len(xs))], label=run.label, drawstyle="steps-post"
                )
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests" if "inter" not in name else "fraction of gaps")
        ax.set_title(f"{name.split(' (')[0]} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _hit_rate_per_turn(ax: Any, runs: Sequence[RunResult]) -> None:
    turns = sorted({int(t) for run in runs for t in run.summary["hit_rate_per_turn"]})
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        hr = run.summary["hit_rate_per_turn"]
        ax.bar(
            [t + i * width for t in turns], [100 * hr.get(str(t), 0.0) for t in turns], width, label=run.label
        )
    ax.set_xticks([t + width * (len(runs) - 1) / 2 for t in turns], [str(t) for t in turns])
    ax.set_xlabel("turn")
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title("prefix hit rate per turn")
    ax.legend(fontsize=8)


def _ttft_over_time(ax: Any, runs: Sequence[RunResult]) -> None:
    from deltaserve.tools.metrics import ttft

    for run in runs:
        rs = sorted((r for r in run.records if r.ok), key=lambda r: r.submit_s)
        ax.scatter([r.submit_s for r in rs], [1000 * (ttft(r) or 0) for r in rs], s=10, label=run.label)
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT over the run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(path: str, runs: Sequence[RunResult], title: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, end to end), hit rate per turn, TTFT over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    _latency_cdfs(list(axes.flat)[:4], runs)
    _hit_rate_per_turn(axes.flat[4], runs)
    _ttft_over_time(axes.flat[5], runs)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
