#!/usr/bin/env python
"""Cache-policy simulator: replay a workload through the real torch-free scheduler and
cache manager at a given KV and checkpoint budget, for several checkpoint admission
policies, and compare their prefix hit rates with an oracle.

    python tools/simulate_cache.py                                  # chat, every policy
    python tools/simulate_cache.py --workload all --checkpoint-slots 4
    python tools/simulate_cache.py --workload agent --checkpoint-mb 400 --kv-mb 512
    python tools/simulate_cache.py --workload shared-prefix --sweep --plot sweep.png
    python tools/simulate_cache.py --sweep 1,2,4,8,400MB,2GB --json sim.json

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
checkpoint ``--checkpoint-bytes`` (default 50 MiB, Qwen3.5-4B-like) and KV
``--kv-bytes-per-token`` (default 32 KiB). Engine settings (block size, checkpoint
interval, staging budget, scheduler policy and limits) come from ``--config``/``--set``.

This module never imports torch (``engine/__init__`` does, so ``engine.config`` is
loaded here without it).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import re
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from deltaserve.cache.admission import ADMISSION_POLICIES
from deltaserve.cache.manager import GDN_CHUNK_SIZE
from deltaserve.engine import cli as engine_cli  # (engine/__init__ is lazy: no torch)
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.sizing import Capacity, build_scheduler
from deltaserve.logs import configure_logging, get_logger
from deltaserve.scheduler import Request
from deltaserve.tools.cache_bounds import checkpoint_belady, kv_only_belady, kv_only_lru
from deltaserve.tools.metrics import RequestRecord, hit_rate, hit_rate_per_turn
from deltaserve.tools.model_sizes import model_sizes
from deltaserve.tools.workloads import (
    ArrivalParams,
    RequestSpec,
    Workload,
    add_workload_args,
    arrival_from_args,
    expand,
    load_codec,
    make_workload,
    params_from_args,
    plan_arrivals,
    synthetic_reply,
    workload_names,
)

log = get_logger("deltaserve.simulate")

MiB = 1024**2
DEFAULT_POLICIES = ("interval", "step-end", "sequence-end", "v1", "default", "oracle")
DEFAULT_CHECKPOINT_BYTES = 50 * MiB  # Qwen3.5-4B-like
DEFAULT_KV_BYTES_PER_TOKEN = 32 * 1024
DEFAULT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CHECKPOINT_SLOTS = 16
DEFAULT_KV_MB = 2048


# ============================================================================ config
@dataclass
class SimConfig:
    """Pool sizes of a simulated model, and the engine config every other setting comes from
    (block size, checkpoint interval and staging, scheduler policy and limits): the simulator
    builds its scheduler with the engine's own ``build_scheduler``."""

    kv_blocks: int = 4096
    checkpoint_slots: int = DEFAULT_CHECKPOINT_SLOTS
    checkpoint_bytes: int = 50 * MiB
    kv_bytes_per_token: int = 32 * 1024
    engine: EngineConfig = field(default_factory=EngineConfig)
    step_s: float = 0.015  # virtual seconds per step ...
    token_s: float = 0.0002  # ... plus per computed token
    check_integrity: bool = False
    #: value model's prefill cost (per token, per token pair); None: CacheManagerConfig's defaults
    prefill_cost: tuple[float, float] | None = None
    model: str = "Qwen3.5-4B-like (default sizes)"
    host_kv_blocks: int = 0  # host tier (0 = off)
    host_checkpoint_slots: int = 0
    h2d_gbps: float = 50.0  # host <-> device copy bandwidth, GB/s (PCIe 5 x16, effective)

    @property
    def block_size(self) -> int:
        return self.engine.cache.block_size

    @property
    def checkpoint_interval(self) -> int:
        return self.engine.cache.checkpoint_interval

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    def capacity(self, kv_blocks: int, checkpoint_slots: int) -> Capacity:
        """The engine's ``Capacity`` for these pool sizes (the model's maximum length is unbounded)."""
        return Capacity(
            budget_bytes=kv_blocks * self.block_size * self.kv_bytes_per_token
            + (checkpoint_slots + self.max_num_seqs) * self.checkpoint_bytes,
            block_size=self.block_size,
            num_kv_blocks=kv_blocks,
            kv_block_bytes=self.block_size * self.kv_bytes_per_token,
            num_live_slots=self.max_num_seqs,
            num_checkpoint_slots=checkpoint_slots,
            state_bytes=self.checkpoint_bytes,
            max_model_len=kv_blocks * self.block_size,
            model_max_len=1 << 30,
            max_num_seqs=self.max_num_seqs,
            num_host_kv_blocks=self.host_kv_blocks,
            num_host_checkpoint_slots=self.host_checkpoint_slots,
        )

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "engine"}
        out["engine"] = self.engine.to_dict()
        return out

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def checkpoint_pool_bytes(self) -> int:
        return self.checkpoint_slots * self.checkpoint_bytes


@dataclass
class SimResult:
    workload: str
    policy: str
    admission: str
    kv_blocks: int
    checkpoint_slots: int
    checkpoint_mb: float
    kv_mb: float
    requests: int
    rejected: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    hit_rate_per_turn: dict[str, float]
    checkpoints_stored: int
    checkpoints_skipped_budget: int
    checkpoints_skipped_pool: int
    checkpoints_skipped_value: int
    checkpoints_evicted: int
    kv_evicted_blocks: int
    hit_tokens_host: int
    host_bytes_moved: int
    preemptions: int
    steps: int
    tokens_computed: int
    sim_time_s: float
    wall_s: float
    oracle_ratio: float | None = None
    #: (prompt ids, reply ids) in submission order (for the offline bounds; not serialized)
    served: list[tuple[list[int], list[int]]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["served"]
        return out


# ============================================================================ simulation
def oracle_sizes(workload: Workload, cfg: SimConfig) -> tuple[int, int]:
    """KV blocks and checkpoint slots that can never run out for this workload."""
    total = 0
    n = 0
    for spec, _ in expand(workload):
        total += len(spec.prompt_ids) + spec.max_tokens
        n += 1
    unit = math.lcm(cfg.block_size, GDN_CHUNK_SIZE)
    blocks = total // cfg.block_size + 2 * n + 16
    slots = total // unit + 2 * n + cfg.max_num_seqs + 16
    return blocks, slots


def simulate(workload: Workload, policy: str, cfg: SimConfig, arrival: ArrivalParams) -> SimResult:
    """Replay ``workload`` through ``Scheduler`` + ``CacheManager`` with ``policy``."""
    t_wall = time.perf_counter()
    oracle = policy == "oracle"
    admission = "every-unit" if oracle else policy
    if admission not in ADMISSION_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: oracle, {', '.join(sorted(ADMISSION_POLICIES))}")
    kv_blocks, slots, engine = cfg.kv_blocks, cfg.checkpoint_slots, cfg.engine
    if oracle:
        kv_blocks, slots = oracle_sizes(workload, cfg)
        engine = engine.replace(**{"cache.checkpoint_staging_bytes": None})
        cfg = replace(cfg, host_kv_blocks=0, host_checkpoint_slots=0)
    engine = engine.replace(**{"cache.enable_prefix_caching": True})
    sched = build_scheduler(engine, cfg.capacity(kv_blocks, slots), checkpoint_policy=admission)
    cache = sched.cache
    if cfg.prefill_cost is not None:
        cache.set_prefill_cost(*cfg.prefill_cost)
    roots = workload.roots()
    plan = plan_arrivals(roots, arrival, workload.seed, default_concurrency=workload.default_concurrency)
    clock = 0.0
    order = itertools.count()
    events: list[tuple[float, int, RequestSpec, str]] = []  # (due, tie, spec, tree)
    live: dict[str, tuple[Request, RequestSpec, list[int], str]] = {}
    tree_left: dict[str, int] = {}
    pending_roots: deque[RequestSpec] = deque()
    active_trees = 0
    concurrency = plan["concurrency"] if plan["mode"] == "closed" else None
    finished: list[tuple[RequestSpec, int]] = []  # (spec, cached tokens)
    served: list[tuple[list[int], list[int]]] = []  # (prompt, reply) in submission order
    rejected = 0
    steps = 0
    tokens = 0

    def push(spec: RequestSpec, due: float, tree: str) -> None:
        heapq.heappush(events, (due, next(order), spec, tree))

    def launch_roots() -> None:
        nonlocal active_trees
        while pending_roots and (concurrency is None or active_trees < concurrency):
            root = pending_roots.popleft()
            active_trees += 1
            tree_left[root.rid] = 1
            push(root, clock, root.rid)

    def tree_done(tree: str, children: int) -> None:
        nonlocal active_trees
        tree_left[tree] += children - 1
        if tree_left[tree] == 0:
            del tree_left[tree]
            active_trees -= 1
            launch_roots()

    def submit(spec: RequestSpec, due: float, tree: str) -> None:
        nonlocal rejected
        if not cache.can_ever_fit(len(spec.prompt_ids) + spec.max_tokens):
            rejected += 1
            tree_done(tree, 0)
            return
        req = Request(request_id=spec.rid, prompt_token_ids=list(spec.prompt_ids), sampling_params=None)
        req.arrival_time = due
        reply = synthetic_reply(workload, spec)
        live[spec.rid] = (req, spec, reply, tree)
        served.append((spec.prompt_ids, reply))
        sched.add(req)

    def complete(req: Request) -> None:
        _, spec, reply, tree = live.pop(req.request_id)
        finished.append((spec, max(req.num_cached_tokens, 0)))
        children = workload.follow_ups(spec, reply)
        for child in children:
            push(child, clock + child.delay_s, tree)
        tree_done(tree, len(children))

    if concurrency is not None:
        pending_roots.extend(roots)
        launch_roots()
    else:
        for root, t in zip(roots, plan["times"], strict=True):
            tree_left[root.rid] = 1
            active_trees += 1
            push(root, t, root.rid)

    while True:
        while events and events[0][0] <= clock:
            due, _, spec, tree = heapq.heappop(events)
            submit(spec, due, tree)
        if sched.has_work():
            out = sched.schedule()
            if out is None:
                if not sched.running and not events:
                    raise RuntimeError(
                        f"simulator stuck: {sched.num_waiting} waiting requests cannot be admitted"
                    )
                clock = events[0][0] if events and not sched.running else clock + cfg.step_s
                continue
            sampled: list[int | None] = []
            for s in out.seqs:
                if s.samples:
                    req = s.request
                    sampled.append(live[req.request_id][2][req.num_output_tokens])
                else:
                    sampled.append(None)
            moved = sum(cache.host.nbytes(t.kind) for t in out.plan.saves + out.plan.loads)
            sched.update(out, sampled)
            steps += 1
            tokens += out.num_tokens
            # copies between tiers cost their bytes over the link, serially (a conservative
            # model: on a GPU the loads overlap the forward)
            clock += cfg.step_s + cfg.token_s * out.num_tokens + moved / (cfg.h2d_gbps * 1e9)
            for s, tok in zip(out.seqs, sampled, strict=True):
                req = s.request
                if tok is not None and req.num_output_tokens >= live[req.request_id][1].max_tokens:
                    sched.finish(req, "length")
                    complete(req)
            if cfg.check_integrity:
                sched.check_integrity()
        elif events:
            clock = max(clock, events[0][0])
        else:
            break

    assert not live and not tree_left, "simulation ended with requests in flight"
    c = cache.counters
    records = [
        RequestRecord(rid=s.rid, turn=s.turn, num_prompt_tokens=len(s.prompt_ids), num_cached_tokens=h)
        for s, h in finished
    ]
    prompt = sum(r.num_prompt_tokens for r in records)
    hit = sum(r.num_cached_tokens for r in records)
    return SimResult(
        workload=workload.name,
        policy=policy,
        admission=admission,
        kv_blocks=kv_blocks,
        checkpoint_slots=slots,
        checkpoint_mb=slots * cfg.checkpoint_bytes / MiB,
        kv_mb=kv_blocks * cfg.block_size * cfg.kv_bytes_per_token / MiB,
        requests=len(finished),
        rejected=rejected,
        prompt_tokens=prompt,
        hit_tokens=hit,
        hit_rate=hit_rate(records),
        hit_rate_per_turn={str(t): v for t, v in hit_rate_per_turn(records).items()},
        checkpoints_stored=c["checkpoints.stored"],
        checkpoints_skipped_budget=c["checkpoints.skipped_budget"],
        checkpoints_skipped_pool=c["checkpoints.skipped_pool"],
        checkpoints_skipped_value=c["checkpoints.skipped_value"],
        checkpoints_evicted=c["checkpoints.evicted"],
        kv_evicted_blocks=c["kv.evicted_blocks"],
        hit_tokens_host=c["prefix_cache.hit_tokens_host"],
        host_bytes_moved=c["host.bytes_saved"] + c["host.bytes_loaded"],
        preemptions=sched.num_preemptions,
        steps=steps,
        tokens_computed=tokens,
        sim_time_s=clock,
        wall_s=time.perf_counter() - t_wall,
        served=served,
    )


def compare_policies(
    workload: Workload, policies: Sequence[str], cfg: SimConfig, arrival: ArrivalParams
) -> list[SimResult]:
    """Every policy on the same workload; ``oracle_ratio`` filled when oracle is among them."""
    results = [simulate(workload, p, cfg, arrival) for p in policies]
    oracle = next((r for r in results if r.policy == "oracle"), None)
    for r in results:
        if oracle is not None:
            r.oracle_ratio = r.hit_rate / oracle.hit_rate if oracle.hit_rate > 0 else None
    return results


@dataclass
class Bounds:
    """Offline ceilings at the run's memory (``tools/cache_bounds.py``), requests one by one
    in the oracle run's submission order."""

    kv_lru: float  # KV alone, LRU: what plain prefix caching of that KV memory hits
    kv_belady: float  # KV alone, clairvoyant
    checkpoint_belady: float  # checkpoints alone (KV unlimited), clairvoyant

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def offline_bounds(oracle: SimResult, cfg: SimConfig) -> Bounds:
    bs = cfg.block_size
    unit = math.lcm(bs, GDN_CHUNK_SIZE)
    return Bounds(
        kv_lru=kv_only_lru(oracle.served, cfg.kv_blocks, bs),
        kv_belady=kv_only_belady(oracle.served, cfg.kv_blocks, bs),
        checkpoint_belady=checkpoint_belady(oracle.served, cfg.checkpoint_slots, bs, unit),
    )


def summary_row(name: str, seed: int, results: Sequence[SimResult], bounds: Bounds | None) -> dict[str, Any]:
    """v1 vs default vs the ceilings, measured in the same run."""
    by = {r.policy: r.hit_rate for r in results}
    row: dict[str, Any] = {
        "workload": name,
        "seed": seed,
        **{p: by.get(p) for p in ("v1", "default", "oracle")},
    }
    row.update(bounds.to_dict() if bounds else {"kv_lru": None, "kv_belady": None, "checkpoint_belady": None})

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    d = row["default"]
    row["default/kv_lru"] = ratio(d, row["kv_lru"])
    row["default/checkpoint_belady"] = ratio(d, row["checkpoint_belady"])
    row["default/v1"] = ratio(d, row["v1"])
    row["default-v1"] = d - row["v1"] if d is not None and row["v1"] is not None else None
    row["default/oracle"] = ratio(d, row["oracle"])
    return row


def format_summary(rows: Sequence[dict[str, Any]]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    def rat(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    out = [["workload", "seed", "v1", "default", "KV LRU", "KV Belady", "ckpt Belady", "oracle",
            "def/KV-LRU", "def/ckpt", "def/v1", "def-v1", "def/oracle"]]  # fmt: skip
    for r in rows:
        out.append([
            r["workload"], str(r["seed"]), pct(r["v1"]), pct(r["default"]), pct(r["kv_lru"]),
            pct(r["kv_belady"]), pct(r["checkpoint_belady"]), pct(r["oracle"]), rat(r["default/kv_lru"]),
            rat(r["default/checkpoint_belady"]), rat(r["default/v1"]),
            "-" if r["default-v1"] is None else f"{100 * r['default-v1']:+.1f}", rat(r["default/oracle"]),
        ])  # fmt: skip
    return _grid(out)


def recommend_pool(
    sweep: dict[int, list[SimResult]], cfg: SimConfig, target: float = 0.9
) -> dict[str, int | None]:
    """Per policy: the smallest swept checkpoint pool (slots) reaching ``target`` x the oracle."""
    oracle = next((r.hit_rate for rs in sweep.values() for r in rs if r.policy == "oracle"), None)
    out: dict[str, int | None] = {}
    for slots in sorted(sweep):
        for r in sweep[slots]:
            if r.policy == "oracle":
                continue
            out.setdefault(r.policy, None)
            if out[r.policy] is None and oracle and r.hit_rate >= target * oracle:
                out[r.policy] = slots
    return out


# ============================================================================ budgets
_UNITS = {"": None, "b": 1, "kb": 1024, "kib": 1024, "mb": MiB, "mib": MiB, "gb": 1024**3, "gib": 1024**3}


def parse_budget(text: str, checkpoint_bytes: int) -> int:
    """Checkpoint slots from ``8`` (slots) or ``400MB`` / ``2GiB`` (memory)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"budget {text!r}: expected slots (8) or memory (400MB, 2GiB)")
    value, unit = float(m.group(1)), _UNITS[m.group(2).lower()]
    return int(value) if unit is None else int(value * unit // checkpoint_bytes)


# ============================================================================ output
def format_results(results: Sequence[SimResult]) -> str:
    header = ["policy", "hit rate", "vs oracle", "from host", "stored", "skipped", "ckpt evicted",
              "KV evicted", "preempt", "steps", "sim s"]  # fmt: skip
    rows = [header]
    for r in results:
        rows.append([
            r.policy,
            f"{100 * r.hit_rate:.1f}%",
            "-" if r.oracle_ratio is None else f"{r.oracle_ratio:.2f}",
            f"{100 * r.hit_tokens_host / max(r.prompt_tokens, 1):.1f}%",
            str(r.checkpoints_stored),
            str(r.checkpoints_skipped_budget + r.checkpoints_skipped_pool + r.checkpoints_skipped_value),
            str(r.checkpoints_evicted),
            str(r.kv_evicted_blocks),
            str(r.preemptions),
            str(r.steps),
            f"{r.sim_time_s:.1f}",
        ])  # fmt: skip
    return _grid(rows)


def format_sweep(sweep: dict[int, list[SimResult]], cfg: SimConfig) -> str:
    policies = [r.policy for r in next(iter(sweep.values()))]
    rows = [["checkpoints", "memory"] + policies]
    for slots, results in sweep.items():
        by = {r.policy: r for r in results}
        rows.append(
            [str(slots), f"{slots * cfg.checkpoint_bytes / MiB:.0f} MiB"]
            + [f"{100 * by[p].hit_rate:.1f}%" for p in policies]
        )
    return _grid(rows)


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append(
            "  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]).rstrip()
        )
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def header_line(workload: Workload, cfg: SimConfig, arrival_mode: str) -> str:
    reqs = expand(workload)
    prompt = sum(len(s.prompt_ids) for s, _ in reqs)
    unit = math.lcm(cfg.block_size, GDN_CHUNK_SIZE)
    return (
        f"workload {workload.name}: {len(reqs)} requests, {prompt} prompt tokens, {arrival_mode}; "
        f"KV {cfg.kv_blocks} blocks x {cfg.block_size} tok = {cfg.kv_bytes / MiB:.0f} MiB; "
        f"checkpoints {cfg.checkpoint_slots} x {cfg.checkpoint_bytes / MiB:.0f} MiB = "
        f"{cfg.checkpoint_pool_bytes / MiB:.0f} MiB; unit {unit} tok; interval {cfg.checkpoint_interval}"
        + (
            f"; host tier KV {cfg.host_kv_blocks * cfg.block_size * cfg.kv_bytes_per_token / MiB:.0f} MiB + "
            f"checkpoints {cfg.host_checkpoint_slots * cfg.checkpoint_bytes / MiB:.0f} MiB at {cfg.h2d_gbps:g} GB/s"
            if cfg.host_kv_blocks or cfg.host_checkpoint_slots
            else ""
        )
    )


def plot_sweep(path: str, sweeps: dict[str, dict[int, list[SimResult]]], cfg: SimConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(sweeps)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
    for ax, (name, sweep) in zip(axes.flat, sweeps.items(), strict=False):
        budgets = list(sweep)
        mb = [s * cfg.checkpoint_bytes / MiB for s in budgets]
        policies = [r.policy for r in sweep[budgets[0]]]
        styles = itertools.cycle([("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-")])
        for p in policies:
            ys = [100 * next(r for r in sweep[b] if r.policy == p).hit_rate for b in budgets]
            if p == "oracle":
                ax.axhline(ys[0], color="black", linestyle="--", label="oracle (unlimited)")
            else:
                marker, line = next(styles)
                ax.plot(mb, ys, marker=marker, linestyle=line, alpha=0.85, label=p)
        ax.set_xscale("log")
        ax.set_xlabel(f"checkpoint memory (MiB; {cfg.checkpoint_bytes / MiB:.0f} MiB each)")
        ax.set_ylabel("prefix hit rate (%)")
        ax.set_ylim(0, 100)
        ax.set_title(f"{name} (KV {cfg.kv_bytes / MiB:.0f} MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    h.add_argument(
        "--h2d-gbps", type=float, default=50.0,
        help="host <-> device bandwidth in GB/s; each step's copies add bytes / bandwidth (default %(default)s)",
    )  # fmt: skip
    t = parser.add_argument_group("virtual time")
    t.add_argument("--step-ms", type=float, default=15.0, help="per step (default %(default)s)")
    t.add_argument("--ms-per-token", type=float, default=0.2, help="per computed token (default %(default)s)")
    o = parser.add_argument_group("output")
    o.add_argument(
        "--tokenizer", help="folder with tokenizer.json, builtin:NAME or synthetic (default: built-in)"
    )
    o.add_argument("--seeds", help="comma list of workload seeds, each run in turn (default: --seed)")
    o.add_argument("--check", action="store_true", help="check_integrity() after every step")
    o.add_argument("--json", metavar="FILE")
    o.add_argument("--plot", metavar="FILE.png", help="hit rate vs checkpoint memory (with --sweep)")
    o.add_argument("--log-level", default="warning")
    return parser


def _model_path_given(args: argparse.Namespace, ecfg: EngineConfig) -> bool:
    """``model.path`` set by ``--set`` or by the ``--config`` file (not the built-in default)."""
    if any(item.split("=", 1)[0].strip() == "model.path" for item in args.set):
        return True
    return bool(args.config) and ecfg.model.path != EngineConfig().model.path


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
    cc = ecfg.cache
    ckpt_bytes, kv_per_token, cost, model = DEFAULT_CHECKPOINT_BYTES, DEFAULT_KV_BYTES_PER_TOKEN, None, None
    if _model_path_given(args, ecfg):
        sizes = model_sizes(ecfg.model.path)
        ckpt_bytes, kv_per_token = sizes.checkpoint_bytes, sizes.kv_bytes_per_token
        cost = (sizes.prefill_flops_per_token, sizes.prefill_flops_per_token_pair)
        model = (
            f"{ecfg.model.path}: {sizes.attention_layers} attention + {sizes.gdn_layers} GDN layers, "
            f"{kv_per_token} B KV/token, {ckpt_bytes / MiB:.2f} MiB/checkpoint"
        )
    ckpt_bytes = args.checkpoint_bytes if args.checkpoint_bytes is not None else ckpt_bytes
    kv_per_token = args.kv_bytes_per_token if args.kv_bytes_per_token is not None else kv_per_token
    ckpt_bytes, kv_per_token = max(ckpt_bytes, 1), max(kv_per_token, 1)
    if args.kv_blocks is not None:
        kv_blocks = args.kv_blocks
    elif args.kv_mb is not None:
        kv_blocks = int(args.kv_mb * MiB // (kv_per_token * cc.block_size))
    elif cc.num_kv_blocks is not None:
        kv_blocks = cc.num_kv_blocks
    else:
        kv_blocks = int(DEFAULT_KV_MB * MiB // (kv_per_token * cc.block_size))
    if args.checkpoint_slots is not None:
        slots = args.checkpoint_slots
    elif args.checkpoint_mb is not None:
        slots = int(args.checkpoint_mb * MiB // ckpt_bytes)
    else:
        slots = DEFAULT_CHECKPOINT_SLOTS
    out = SimConfig(
        kv_blocks=max(kv_blocks, 1),
        checkpoint_slots=max(slots, 0),
        checkpoint_bytes=ckpt_bytes,
        kv_bytes_per_token=kv_per_token,
        engine=ecfg,
        step_s=args.step_ms / 1000,
        token_s=args.ms_per_token / 1000,
        check_integrity=args.check,
        prefill_cost=cost,
        host_kv_blocks=int(args.host_kv_mb * MiB // (kv_per_token * cc.block_size)),
        host_checkpoint_slots=int(args.host_checkpoint_mb * MiB // ckpt_bytes),
        h2d_gbps=args.h2d_gbps,
    )
    if model:
        out.model = model
    return out


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
    mode = plan["mode"] + (
        f" {plan['rate']}/s" if plan["rate"] else f" x{plan['concurrency']}" if plan["concurrency"] else ""
    )
    print(header_line(workload, cfg, mode) + f"; seed {args.seed}")
    results = compare_policies(workload, policies, cfg, arrival)
    print(format_results(results))
    entry: dict[str, Any] = {
        "params": workload.describe(),
        "arrivals": {k: v for k, v in plan.items() if k != "times"},
        "results": [r.to_dict() for r in results],
    }
    oracle = next((r for r in results if r.policy == "oracle"), None)
    bounds = offline_bounds(oracle, cfg) if oracle is not None else None
    if bounds is not None:
        entry["bounds"] = bounds.to_dict()
        print(
            f"bounds: KV alone LRU {100 * bounds.kv_lru:.1f}%, Belady {100 * bounds.kv_belady:.1f}%; "
            f"checkpoints alone Belady {100 * bounds.checkpoint_belady:.1f}%"
        )
    summary.append(summary_row(name, args.seed, results, bounds))
    if budgets:
        sweep: dict[int, list[SimResult]] = {}
        for b in budgets:
            rs = [
                simulate(workload, p, replace(cfg, checkpoint_slots=b), arrival)
                for p in policies
                if p != "oracle"
            ]
            for r in rs:
                r.oracle_ratio = r.hit_rate / oracle.hit_rate if oracle and oracle.hit_rate > 0 else None
            sweep[b] = rs + ([oracle] if oracle else [])
        print(f"\nsweep over checkpoint budgets ({name}, hit rate):")
        print(format_sweep(sweep, cfg))
        entry["sweep"] = {str(b): [r.to_dict() for r in rs] for b, rs in sweep.items()}
        if oracle is not None:
            rec = recommend_pool(sweep, cfg)
            entry["recommended_slots"] = rec
            print("smallest checkpoint pool reaching 90% of the oracle: " + "; ".join(
                f"{p} {n} slots ({n * cfg.checkpoint_bytes / MiB:.0f} MiB)" if n is not None
                else f"{p} none of the swept budgets" for p, n in rec.items()
            ))  # fmt: skip
        sweeps[name] = sweep
    print()
    return entry


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    cfg = sim_config_from_args(args)
    try:
        names = workload_names(args.workload)
        budgets = [parse_budget(b, cfg.checkpoint_bytes) for b in (args.sweep or "").split(",") if b.strip()]
    except ValueError as e:
        parser.error(str(e))
    if args.plot and not budgets:
        budgets = list(DEFAULT_SWEEP)
    if "trace" in names and not args.trace:
        parser.error("the trace workload needs --trace FILE")
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
    if len(summary) and any(r["default"] is not None for r in summary):
        print(
            f"summary ({cfg.model}; KV {cfg.kv_bytes / MiB:.0f} MiB, checkpoints {cfg.checkpoint_pool_bytes / MiB:.0f} MiB):"
        )
        print(format_summary(summary))
        print(
            "KV LRU / KV Belady: KV alone, requests one by one; ckpt Belady: checkpoints alone (KV unlimited),"
        )
        print("clairvoyant; oracle: every unit boundary, unlimited memory, the same concurrency.\n")
        doc["summary"] = summary
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        plot_sweep(args.plot, sweeps, cfg)
        print(f"wrote {args.plot}")
    return doc


if __name__ == "__main__":
    main()
