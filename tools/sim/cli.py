#!/usr/bin/env python
"""Cache-policy simulator: replay a workload through the real torch-free scheduler and
cache manager at a given KV and checkpoint budget, for several checkpoint admission
policies, and compare their prefix hit rates with an oracle.

    python tools/simulate_cache.py                                  # chat, every policy
    python tools/simulate_cache.py --workload all --checkpoint-slots 4
    python tools/simulate_cache.py --workload agent --checkpoint-mb 400 --kv-mb 512
    python tools/simulate_cache.py --workload shared-prefix --sweep --plot sweep.png
    python tools/simulate_cache.py --sweep 1,2,4,8,400MB,2GB --json sim.json
    python tools/simulate_cache.py --workload trace --trace T.jsonl --policies default --bounds

What runs is the engine's own ``Scheduler`` (``scheduler.schedule()`` /
``scheduler.update(out, sampled)`` / ``scheduler.finish(req, "length")``) over its own
``CacheManager``: the same joint-hit rule, staging budget, pins and eviction. Only the
model is replaced: every scheduled step "samples" the next token of a deterministic
synthetic reply of the requested length (``workloads.synthetic_reply``), and the clock
is virtual (``--step-ms`` + ``--ms-per-token`` per step), which sets arrivals, think
times and concurrency.

Policies (``cache/admission.py``): ``interval``, ``step-end``, ``sequence-end``,
``default``, ``every-unit``, ``none``, and ``oracle`` = ``every-unit`` with unlimited KV
and checkpoint memory (and no staging limit). Budgets are given for a real model: one
checkpoint ``--checkpoint-bytes`` (default 50 MiB, Qwen3.5-4B-like; 26 MiB with
``--set model.ssm_state_dtype=bfloat16``) and KV
``--kv-bytes-per-token`` (default 32 KiB). Engine settings (block size, checkpoint
interval, staging budget, scheduler policy and limits) come from ``--config``/``--set``.
A host tier (``--host-memory-mb``) and a disk tier below it (``--disk-gb``, with its read
bandwidth and write budget; ``tools/sim/disk.py``) widen the cache.

This module is the command line (its entry point: ``tools/simulate_cache.py``); the simulation
is ``tools/sim/simulation.py`` (``Simulation``), tables, bounds and plots ``tools/sim/report.py``.
None of them imports torch (``engine/__init__`` is lazy, so ``engine.config`` loads without it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from deltaserve.engine import cli as engine_cli  # (engine/__init__ is lazy: no torch)
from deltaserve.engine.config import EngineConfig
from deltaserve.logs import configure_logging, get_logger
from deltaserve.tools.sim.model_sizes import model_sizes
from deltaserve.tools.sim.report import (
    Bounds,
    format_attribution,
    format_bound_ratios,
    format_results,
    format_splits,
    format_summary,
    format_sweep,
    header_line,
    offline_bounds,
    plot_sweep,
    recommend_pool,
    summary_row,
)
from deltaserve.tools.sim.simulation import (
    DEFAULT_CHECKPOINT_SLOTS,
    GiB,
    MiB,
    SimConfig,
    SimResult,
    Simulation,
    compare_policies,
    oracle_sizes,
    simulate,
)
from deltaserve.tools.workloads import (
    ArrivalParams,
    Workload,
    add_workload_args,
    arrival_from_args,
    load_codec,
    make_workload,
    params_from_args,
    plan_arrivals,
    workload_names,
)

__all__ = [
    "Bounds",
    "SimConfig",
    "SimResult",
    "Simulation",
    "build_parser",
    "compare_policies",
    "main",
    "offline_bounds",
    "oracle_sizes",
    "parse_budget",
    "recommend_pool",
    "sim_config_from_args",
    "simulate",
]

log = get_logger("deltaserve.simulate")

DEFAULT_POLICIES = ("interval", "step-end", "sequence-end", "v1", "default", "oracle")
DEFAULT_CHECKPOINT_BYTES = 50 * MiB  # Qwen3.5-4B-like
DEFAULT_STATE_BYTES = 48 * MiB  # of it, the float32 recurrent state
#: the same with ``model.ssm_state_dtype = "bfloat16"``: that state halved
DEFAULT_CHECKPOINT_BYTES_BF16_STATE = DEFAULT_CHECKPOINT_BYTES - DEFAULT_STATE_BYTES // 2
DEFAULT_KV_BYTES_PER_TOKEN = 32 * 1024
DEFAULT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_KV_MB = 2048


# ============================================================================ budgets
_UNITS = {"": None, "b": 1, "kb": 1024, "kib": 1024, "mb": MiB, "mib": MiB, "gb": 1024**3, "gib": 1024**3}


def parse_budget(text: str, checkpoint_bytes: int) -> int:
    """Checkpoint slots from ``8`` (slots) or ``400MB`` / ``2GiB`` (memory)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"budget {text!r}: expected slots (8) or memory (400MB, 2GiB)")
    value, unit = float(m.group(1)), _UNITS[m.group(2).lower()]
    return int(value) if unit is None else int(value * unit // checkpoint_bytes)


# ============================================================================ main
def build_parser() -> argparse.ArgumentParser:
    cli = engine_cli
    parser = argparse.ArgumentParser(
        prog="simulate_cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_config_args(parser)
    add_workload_args(parser, multi=True)
    g = parser.add_argument_group("budgets")
    g.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="comma list (default %(default)s)")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks", type=int, help="KV budget in blocks")
    kv.add_argument(
        "--kv-mb", type=float, help=f"KV budget in MiB (default {DEFAULT_KV_MB}, or cache.num_kv_blocks)"
    )
    g.add_argument(
        "--kv-bytes-per-token", type=int,
        help="default: model.path's config.json when --config/--set names one, else 32768 (32 KiB, 4B-like)",
    )  # fmt: skip
    ck = g.add_mutually_exclusive_group()
    ck.add_argument(
        "--checkpoint-slots",
        type=int,
        help=f"checkpoint budget in slots (default {DEFAULT_CHECKPOINT_SLOTS})",
    )
    ck.add_argument("--checkpoint-mb", type=float, help="checkpoint budget in MiB")
    g.add_argument(
        "--memory-mb",
        type=float,
        help="one device budget in MiB for KV and checkpoints, traded by value (instead of the "
        "fixed pools; with --sweep, fixed splits of the same bytes run beside it)",
    )
    g.add_argument(
        "--checkpoint-bytes", type=int,
        help="one checkpoint (default: model.path's config.json when --config/--set names one, else 50 MiB)",
    )  # fmt: skip
    g.add_argument("--checkpoint-interval", type=int, help="tokens (default: cache.checkpoint_interval)")
    g.add_argument(
        "--staging-mb", type=float, help="per-step capture budget (default: cache.checkpoint_staging_bytes)"
    )
    g.add_argument(
        "--sweep", nargs="?", const=",".join(map(str, DEFAULT_SWEEP)), metavar="BUDGETS",
        help="sweep checkpoint budgets: slots or memory, comma list (default %(const)s slots)",
    )  # fmt: skip
    h = parser.add_argument_group("host tier")
    h.add_argument("--host-kv-mb", type=float, default=0.0, help="host KV pool in MiB (default 0: off)")
    h.add_argument(
        "--host-checkpoint-mb", type=float, default=0.0, help="host checkpoint pool in MiB (default 0: off)"
    )
    d = parser.add_argument_group("disk tier")
    d.add_argument("--disk-gb", type=float, default=0.0, help="disk tier capacity in GiB (default 0: off)")
    for group, flag, default, text in (
        (h, "--host-memory-mb", 0.0, "one host budget in MiB for KV and checkpoints, traded by value (pages of one "
         "checkpoint's size, each one checkpoint or N KV blocks); instead of --host-kv-mb / --host-checkpoint-mb"),
        (h, "--h2d-gbps", 50.0, "host <-> device bandwidth in GB/s; each step's copies add bytes / bandwidth "
         "(default %(default)s)"),
        (d, "--disk-read-gbps", 2.0, "disk read bandwidth in GB/s, one reader: a hit from disk waits bytes / "
         "bandwidth (default %(default)s: one NVMe SSD)"),
        (d, "--disk-write-mbps", 1000.0, "the disk tier's write budget in MB/s, write-through and write-back "
         "(DiskTier's write_bytes_per_s; default %(default)s: half an NVMe's sustained writes)"),
    ):  # fmt: skip
        group.add_argument(flag, type=float, default=default, help=text)
    t = parser.add_argument_group("virtual time")
    t.add_argument("--step-ms", type=float, default=15.0, help="per step (default %(default)s)")
    t.add_argument("--ms-per-token", type=float, default=0.2, help="per computed token (default %(default)s)")
    o = parser.add_argument_group("output")
    o.add_argument(
        "--tokenizer", help="folder with tokenizer.json, builtin:NAME or synthetic (default: built-in)"
    )
    o.add_argument("--seeds", help="comma list of workload seeds, each run in turn (default: --seed)")
    o.add_argument("--check", action="store_true", help="check_integrity() after every step")
    o.add_argument(
        "--bounds", action="store_true",
        help="compute the offline bounds (KV-LRU over every tier included) without the oracle: from the "
        "requests the first policy's run submitted, in its submission order (open-loop arrivals, a trace "
        "among them: arrival order, the oracle's too); with oracle among --policies its run is used",
    )  # fmt: skip
    o.add_argument(
        "--hybrid-lru", action="store_true",
        help="with the bounds, also the hybrid LRU over the same bytes (KV and exact checkpoints, each its "
        "bytes, LRU, a checkpoint at every computed end and fork): a reference for chat whose next turn "
        "extends the last one's end (tools/sim/hybrid_bound.py); elsewhere the cache's own choices beat it",
    )  # fmt: skip
    o.add_argument("--json", metavar="FILE")
    o.add_argument("--plot", metavar="FILE.png", help="hit rate vs checkpoint memory (with --sweep)")
    o.add_argument("--log-level", default="warning")
    return parser


def _model_path_given(args: argparse.Namespace, ecfg: EngineConfig) -> bool:
    """``model.path`` set by ``--set`` or by the ``--config`` file (not the built-in default)."""
    if any(item.split("=", 1)[0].strip() == "model.path" for item in args.set):
        return True
    return bool(args.config) and ecfg.model.path != EngineConfig().model.path


def _model_defaults(
    args: argparse.Namespace, ecfg: EngineConfig
) -> tuple[int, int, tuple[float, float] | None, str | None]:
    """Checkpoint bytes, KV bytes per token, the value model's prefill cost and a description:
    from ``model.path``'s config.json when ``--config``/``--set`` names one, else 4B-like."""
    state = ecfg.model.ssm_state_dtype.value
    if not _model_path_given(args, ecfg):
        if state == "bfloat16":
            model = "Qwen3.5-4B-like (default sizes, bfloat16 recurrent state)"
            return DEFAULT_CHECKPOINT_BYTES_BF16_STATE, DEFAULT_KV_BYTES_PER_TOKEN, None, model
        return DEFAULT_CHECKPOINT_BYTES, DEFAULT_KV_BYTES_PER_TOKEN, None, None
    sizes = model_sizes(ecfg.model.path, state)
    cost = (sizes.prefill_flops_per_token, sizes.prefill_flops_per_token_pair)
    model = (
        f"{ecfg.model.path}: {sizes.attention_layers} attention + {sizes.gdn_layers} GDN layers, "
        f"{sizes.kv_bytes_per_token} B KV/token, {sizes.checkpoint_bytes / MiB:.2f} MiB/checkpoint"
    )
    return sizes.checkpoint_bytes, sizes.kv_bytes_per_token, cost, model


def _kv_blocks(args: argparse.Namespace, ecfg: EngineConfig, kv_per_token: int) -> int:
    """``--kv-blocks``, else ``--kv-mb``, else ``cache.num_kv_blocks``, else ``DEFAULT_KV_MB``."""
    cc = ecfg.cache
    if args.kv_blocks is not None:
        return args.kv_blocks
    if args.kv_mb is not None:
        return int(args.kv_mb * MiB // (kv_per_token * cc.block_size))
    if cc.num_kv_blocks is not None:
        return cc.num_kv_blocks
    return int(DEFAULT_KV_MB * MiB // (kv_per_token * cc.block_size))


def _checkpoint_slots(args: argparse.Namespace, ckpt_bytes: int) -> int:
    if args.checkpoint_slots is not None:
        return args.checkpoint_slots
    if args.checkpoint_mb is not None:
        return int(args.checkpoint_mb * MiB // ckpt_bytes)
    return DEFAULT_CHECKPOINT_SLOTS


def sim_config_from_args(args: argparse.Namespace) -> SimConfig:
    """Budgets from the flags; block size, interval, staging and scheduler from the engine
    config; checkpoint and KV sizes (and the value model's prefill cost) from the flags, else
    from ``model.path``'s config.json when ``--config``/``--set`` names one, else 4B-like."""
    base: dict[str, object] = {}
    if args.checkpoint_interval is not None:
        base["cache.checkpoint_interval"] = args.checkpoint_interval
    if args.staging_mb is not None:
        base["cache.checkpoint_staging_bytes"] = int(args.staging_mb * MiB)
    ecfg = engine_cli.config_from_args(args, base)
    ckpt_bytes, kv_per_token, cost, model = _model_defaults(args, ecfg)
    ckpt_bytes = args.checkpoint_bytes if args.checkpoint_bytes is not None else ckpt_bytes
    kv_per_token = args.kv_bytes_per_token if args.kv_bytes_per_token is not None else kv_per_token
    ckpt_bytes, kv_per_token = max(ckpt_bytes, 1), max(kv_per_token, 1)
    block_bytes = kv_per_token * ecfg.cache.block_size
    out = SimConfig(
        kv_blocks=max(_kv_blocks(args, ecfg, kv_per_token), 1),
        checkpoint_slots=max(_checkpoint_slots(args, ckpt_bytes), 0),
        checkpoint_bytes=ckpt_bytes,
        kv_bytes_per_token=kv_per_token,
        engine=ecfg,
        step_s=args.step_ms / 1000,
        token_s=args.ms_per_token / 1000,
        check_integrity=args.check,
        prefill_cost=cost,
        host_kv_blocks=int(args.host_kv_mb * MiB // block_bytes),
        host_checkpoint_slots=int(args.host_checkpoint_mb * MiB // ckpt_bytes),
        host_memory_bytes=int(args.host_memory_mb * MiB),
        h2d_gbps=args.h2d_gbps,
        disk_bytes=int(args.disk_gb * GiB),
        disk_read_gbps=args.disk_read_gbps,
        disk_write_mbps=args.disk_write_mbps,
    )
    if args.memory_mb is not None:  # each kind could take it all: the bounds see the whole budget
        total = int(args.memory_mb * MiB)
        out = replace(
            out,
            memory_bytes=total,
            kv_blocks=max(total // block_bytes, 1),
            checkpoint_slots=total // ckpt_bytes,
        )
    if model:
        out.model = model
    return out


def sweep_budgets(
    workload: Workload,
    policies: Sequence[str],
    cfg: SimConfig,
    arrival: ArrivalParams,
    budgets: Sequence[int],
    oracle: SimResult | None,
) -> dict[int, list[SimResult]]:
    """Every policy but the oracle at each checkpoint budget (slots); the one oracle run (its
    pools are unlimited whatever the budget) closes each row."""
    sweep: dict[int, list[SimResult]] = {}
    for b in budgets:
        fixed = replace(cfg, checkpoint_slots=b)
        if cfg.memory_bytes is not None:  # a fixed split of the one budget's bytes
            kv = (cfg.memory_bytes - b * cfg.checkpoint_bytes) // (cfg.block_size * cfg.kv_bytes_per_token)
            if kv < 1:
                continue
            fixed = replace(fixed, memory_bytes=None, kv_blocks=kv)
        rs = [simulate(workload, p, fixed, arrival) for p in policies if p != "oracle"]
        for r in rs:
            r.oracle_ratio = r.hit_rate / oracle.hit_rate if oracle and oracle.hit_rate > 0 else None
        sweep[b] = rs + ([oracle] if oracle else [])
    return sweep


def _report_sweep(
    name: str, sweep: dict[int, list[SimResult]], cfg: SimConfig, oracle: SimResult | None
) -> dict[str, Any]:
    """Print the sweep (and the smallest pool reaching 90 % of the oracle); its JSON entries."""
    print(f"\nsweep over checkpoint budgets ({name}, hit rate):")
    print(format_sweep(sweep, cfg))
    entry: dict[str, Any] = {"sweep": {str(b): [r.to_dict() for r in rs] for b, rs in sweep.items()}}
    if oracle is not None:
        rec = recommend_pool(sweep, cfg)
        entry["recommended_slots"] = rec
        print("smallest checkpoint pool reaching 90% of the oracle: " + "; ".join(
            f"{p} {n} slots ({n * cfg.checkpoint_bytes / MiB:.0f} MiB)" if n is not None
            else f"{p} none of the swept budgets" for p, n in rec.items()
        ))  # fmt: skip
    return entry


def _report_splits(
    name: str, sweep: dict[int, list[SimResult]], shared: Sequence[SimResult], cfg: SimConfig
) -> dict[str, Any]:
    """Print fixed splits of the one budget beside it, and its ratio to the best of them."""
    print(
        f"\none budget of {cfg.memory_bytes / MiB:.0f} MiB vs fixed splits of the same bytes ({name}, hit rate):"
    )
    print(format_splits(sweep, shared, cfg))
    best: dict[str, dict[str, float]] = {}
    for r in shared:
        if r.policy == "oracle":  # (its pools are unlimited: no split of it is fixed)
            continue
        fixed = [x for rs in sweep.values() for x in rs if x.policy == r.policy]
        if fixed:
            # the hit rate counts a request's first admission only: what a split recomputes
            # after preemptions shows in the tokens it computes, printed beside it
            top = max(fixed, key=lambda x: x.hit_rate)
            best[r.policy] = {
                "one_budget": r.hit_rate,
                "best_fixed": top.hit_rate,
                "ratio": r.hit_rate / top.hit_rate if top.hit_rate else 0.0,
                "computed_ratio": r.tokens_computed / top.tokens_computed if top.tokens_computed else 0.0,
            }
            print(
                f"{r.policy}: one budget {100 * r.hit_rate:.1f}% vs best fixed split {100 * top.hit_rate:.1f}% "
                f"(x{best[r.policy]['ratio']:.3f}), computing {r.tokens_computed} tokens vs its "
                f"{top.tokens_computed} (x{best[r.policy]['computed_ratio']:.3f}, preemptions "
                f"{r.preemptions} vs {top.preemptions}); checkpoints held "
                f"{100 * (r.checkpoint_share or 0):.0f}% of the pages on average"
            )
    return {
        "splits": {str(b): [r.to_dict() for r in rs] for b, rs in sweep.items()},
        "one_budget_vs_best": best,
    }


def _arrival_mode(plan: dict[str, Any]) -> str:
    return plan["mode"] + (
        f" {plan['rate']}/s" if plan["rate"] else f" x{plan['concurrency']}" if plan["concurrency"] else ""
    )


def run_workload(
    args: argparse.Namespace,
    name: str,
    cfg: SimConfig,
    codec: Any,
    policies: list[str],
    arrival: ArrivalParams,
    budgets: list[int],
    sweeps: dict[str, dict[int, list[SimResult]]],
    summary: list[dict[str, Any]],
) -> dict[str, Any]:
    """One workload (at ``args.seed``): every policy, the bounds, the sweep; printed."""
    workload = make_workload(params_from_args(args, name=name, block_size=cfg.block_size), codec)
    plan = plan_arrivals(
        workload.roots(), arrival, args.seed, default_concurrency=workload.default_concurrency
    )
    print(header_line(workload, cfg, _arrival_mode(plan)) + f"; seed {args.seed}; tokens {codec.name}")
    results = compare_policies(workload, policies, cfg, arrival)
    print(format_results(results))
    entry: dict[str, Any] = {
        "params": workload.describe(),
        "arrivals": {k: v for k, v in plan.items() if k != "times"},
        "results": [r.to_dict() for r in results],
    }
    oracle = next((r for r in results if r.policy == "oracle"), None)
    source = oracle if oracle is not None else results[0] if args.bounds and results else None
    bounds = offline_bounds(source, cfg, hybrid=args.hybrid_lru) if source is not None else None
    if bounds is not None:
        entry["bounds"] = bounds.to_dict()
        entry["bounds_from"] = source.policy
        print(
            f"bounds: KV alone LRU {100 * bounds.kv_lru:.1f}%, Belady {100 * bounds.kv_belady:.1f}%; "
            f"checkpoints alone Belady {100 * bounds.checkpoint_belady:.1f}%"
            + (
                f"; KV alone LRU over the memory tiers' bytes {100 * bounds.kv_lru_host:.1f}%"
                if bounds.kv_lru_host is not None
                else ""
            )
            + (
                f"; over every tier's bytes, the disk's too {100 * bounds.kv_lru_disk:.1f}%"
                if bounds.kv_lru_disk is not None
                else ""
            )
            + f" (from {source.policy}'s {len(source.served)} submitted requests, in submission order)"
        )
        print(format_bound_ratios(results, bounds))
    attribution = format_attribution(results, bounds)
    if attribution:
        print(attribution)
    summary.append(summary_row(name, args.seed, results, bounds))
    if budgets:
        sweeps[name] = sweep = sweep_budgets(workload, policies, cfg, arrival, budgets, oracle)
        if cfg.memory_bytes is not None:
            entry.update(_report_splits(name, sweep, results, cfg))
        else:
            entry.update(_report_sweep(name, sweep, cfg, oracle))
    print()
    return entry


def _names_and_budgets(
    parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: SimConfig
) -> tuple[list[str], list[int]]:
    """The workloads to run and the swept checkpoint budgets (slots); flag errors exit."""
    try:
        names = workload_names(args.workload)
        budgets = [parse_budget(b, cfg.checkpoint_bytes) for b in (args.sweep or "").split(",") if b.strip()]
    except ValueError as e:
        parser.error(str(e))
    if args.plot and not budgets:
        budgets = list(DEFAULT_SWEEP)
    if "trace" in names and not args.trace:
        parser.error("the trace workload needs --trace FILE")
    return names, budgets


def _print_summary(summary: Sequence[dict[str, Any]], cfg: SimConfig) -> None:
    pools = (
        f"one budget {cfg.memory_bytes / MiB:.0f} MiB for KV and checkpoints"
        if cfg.memory_bytes is not None
        else f"KV {cfg.kv_bytes / MiB:.0f} MiB, checkpoints {cfg.checkpoint_pool_bytes / MiB:.0f} MiB"
    )
    print(f"summary ({cfg.model}; {pools}):")
    print(format_summary(summary))
    print("KV LRU / KV Belady: KV alone, requests one by one; ckpt Belady: checkpoints alone (KV unlimited),")
    print("clairvoyant; oracle: every unit boundary, unlimited memory, the same concurrency;")
    print("hybrid LRU: KV and exact checkpoints (each its bytes) in the widest bytes, LRU, one by one.\n")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.host_memory_mb and (args.host_kv_mb or args.host_checkpoint_mb):
        parser.error("--host-memory-mb is one host budget: not with --host-kv-mb / --host-checkpoint-mb")
    if args.disk_gb < 0 or args.disk_read_gbps <= 0 or args.disk_write_mbps <= 0:
        parser.error("--disk-gb must be >= 0, --disk-read-gbps and --disk-write-mbps > 0")
    configure_logging(args.log_level)
    cfg = sim_config_from_args(args)
    names, budgets = _names_and_budgets(parser, args, cfg)
    codec = load_codec(args.tokenizer)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    arrival = arrival_from_args(args)
    doc: dict[str, Any] = {
        "tool": "deltaserve.simulate_cache",
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "sim_config": cfg.to_dict(),
        "codec": codec.name,
        "policies": policies,
        "workloads": {},
    }
    sweeps: dict[str, dict[int, list[SimResult]]] = {}
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    summary: list[dict[str, Any]] = []
    for name in names:
        for seed in seeds:
            args.seed = seed
            key = name if len(seeds) == 1 else f"{name}:{seed}"
            doc["workloads"][key] = run_workload(
                args, name, cfg, codec, policies, arrival, budgets, sweeps, summary
            )
    if summary and any(r["default"] is not None for r in summary):
        _print_summary(summary, cfg)
        doc["summary"] = summary
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        plot_sweep(args.plot, sweeps, cfg)
        print(f"wrote {args.plot}")
    return doc
