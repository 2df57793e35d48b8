#!/usr/bin/env python
"""CPU step times against the memory-bandwidth roofline, and where a step's time goes.

Prints, for one model on this machine:

* the roofline: STREAM-like copy and triad bandwidth (torch, arrays far larger than the last
  cache level) and the decode bound it implies, ``weight bytes / bandwidth``: a decode step
  reads every weight once (the tied embedding once, as the head), whatever the batch; and the
  fp32 GEMM rate, which bounds a prefill: ``2 * tokens * projection weights / rate``;
* measured engine step times (real ``EngineCore.step()`` calls: scheduler, cache planning,
  batch building, forward, sampler, outputs): decode at batch 1 and 4, and a prefill of
  ``--prefill-len`` tokens; medians, the forward's share, and each time over the bound;
* the top ops of a ``torch.profiler`` trace of decode steps (batch 4) and of one prefill
  (self CPU time), and the step time outside any op (Python: scheduling, bookkeeping).

    python tools/bench/profile_cpu.py --model /path/to/folder --threads 1
    python tools/bench/profile_cpu.py                     # the built-in tiny model (a smoke run)

Prompts are random token ids, distinct per request, so nothing hits the prefix cache.
Greedy decoding with EOS ignored: every request decodes as many tokens as asked.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from deltaserve.engine import EngineConfig, EngineCore, SamplingParams
from deltaserve.engine.byte_size import bytes_arg
from deltaserve.engine.core.step_phases import TimedPhases
from deltaserve.logs import configure_logging
from deltaserve.models.linear import linear
from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, repeat, scaled, spread

BANDWIDTH_BYTES = 256 * 1024**2  # per array: far beyond any last-level cache


@dataclass
class Bandwidth:
    copy_gbs: float  # (read + write) bytes per second of a.copy_(b)
    triad_gbs: float  # (2 reads + 1 write) of a = b + s * c

    @property
    def best(self) -> float:
        return max(self.copy_gbs, self.triad_gbs)


def _best_time(fn: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` calls after a warm-up one: a bandwidth or FLOP roof is what the
    machine can do, so the least disturbed call is the estimate (not the median)."""

    def call() -> None:
        fn()

    return spread(repeat(call, reps, warmup=1))["min"]


def measure_bandwidth(num_bytes: int = BANDWIDTH_BYTES, reps: int = 5) -> Bandwidth:
    """Copy and triad bandwidth with torch's current thread count (best of ``reps``). Write
    traffic is counted once (no write-allocate read), as STREAM does."""
    n = num_bytes // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.ones(n)
    copy = _best_time(lambda: a.copy_(b), reps)
    triad = _best_time(lambda: torch.add(b, c, alpha=2.0, out=a), reps)
    return Bandwidth(copy_gbs=2 * num_bytes / copy / 1e9, triad_gbs=3 * num_bytes / triad / 1e9)


def measure_gemm_gflops(size: int = 1536, reps: int = 3) -> float:
    """GFLOP/s of a square fp32 product through ``models.linear`` (the path the model's
    projections take): the compute roof of a prefill."""
    x, w = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / _best_time(lambda: linear(x, w), reps) / 1e9


def projection_params(model: nn.Module) -> int:
    """Weights of the per-token projections (every ``nn.Linear`` but the head): a prefill of
    ``n`` tokens does ``2 * n`` FLOPs per weight in them (attention and the GDN scan excluded)."""
    head = getattr(model, "lm_head", None)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (a tied head is the
    embedding)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


class ForwardTimer(TimedPhases):
    """The engine's step-phase recorder (``engine/core/step_phases.py``), read for the time in the
    forward phase (the model plus the state copies around it) since the last ``take``."""

    def take(self) -> float:
        seconds = self.ns["forward"] / 1e9
        self.reset()
        return seconds


@dataclass
class StepTimes:
    case: str
    steps: int
    step_ms: float  # median wall time of EngineCore.step()
    forward_ms: float  # median time in the forward phase (engine/core/step_phases.py)
    cpu_ms: float  # median process CPU time of a step: robust to other processes on the cores
    bound_ms: float = 0.0
    step_ms_spread: dict[str, float] = field(default_factory=dict)  # harness.spread of the wall times

    @property
    def ratio(self) -> float:
        return self.step_ms / self.bound_ms if self.bound_ms else 0.0


class StepRunner:
    """An engine and random distinct prompts."""

    def __init__(self, core: EngineCore, timer: ForwardTimer, seed: int = 0) -> None:
        self.core = core
        self.timer = timer
        self.rng = random.Random(seed)
        # ids from a small range: any tokenizer's special ids stay out of the prompts
        self.vocab = min(int(core.vocab_size), 32000)

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(length)]

    def add(self, num: int, prompt_len: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(num):
            self.core.add_request(self.core.make_request(self.prompt(prompt_len), params))

    def timed_step(self) -> tuple[float, float, float]:
        """Wall time, time in the forward, process CPU time of one step."""
        self.timer.take()
        c0, t0 = time.process_time(), time.perf_counter()
        self.core.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return wall, self.timer.take(), cpu

    def drain(self) -> None:
        while self.core.has_work():
            self.core.step()

    def decode(self, batch: int, context: int, steps: int, warmup: int = 2) -> StepTimes:
        """``steps`` decode steps of ``batch`` sequences of ``context`` tokens of prompt."""
        self.add(batch, context, steps + warmup + 2)
        while any(r.num_output_tokens == 0 for r in self.core.scheduler.requests.values()):
            self.core.step()  # the prefills (and their first tokens)
        for _ in range(warmup):
            self.core.step()
        walls, fwds, cpus = zip(*(self.timed_step() for _ in range(steps)), strict=True)
        self.drain()
        return _step_times(f"decode b={batch}", walls, fwds, cpus)

    def prefill(self, length: int, reps: int) -> StepTimes:
        """One request of ``length`` prompt tokens, prefilled in one step (``reps`` times)."""
        walls, fwds, cpus = [], [], []
        for _ in range(reps):
            self.add(1, length, 1)
            wall, fwd, cpu = self.timed_step()
            walls.append(wall)
            fwds.append(fwd)
            cpus.append(cpu)
            self.drain()
        return _step_times(f"prefill {length}", walls, fwds, cpus)


def _step_times(case: str, walls: Sequence[float], fwds: Sequence[float], cpus: Sequence[float]) -> StepTimes:
    """The medians in ms, and the wall times' spread."""
    wall = scaled(spread(walls), 1e3, 6)
    fwd, cpu = (1e3 * spread(x)["median"] for x in (fwds, cpus))
    return StepTimes(case, len(walls), wall["median"], fwd, cpu, step_ms_spread=wall)


def profile_table(run: Callable[[], object], top: int) -> tuple[str, float, float]:
    """Trace ``run`` with torch.profiler: the top-ops table (self CPU time), the wall time and
    the time inside top-level ops (the rest is Python between ops)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
    events = prof.events()
    in_ops = sum(e.cpu_time_total for e in events if e.cpu_parent is None) / 1e6
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40)
    return table, wall, in_ops


def build_engine(args: argparse.Namespace, timer: ForwardTimer) -> EngineCore:
    config = EngineConfig.from_dict(
        {
            "model": {"path": args.model},
            "cache": {"memory_bytes": args.cache_bytes},
            # The engine sets torch's threads itself (engine.cpu_threads); pass ours through.
            "engine": {"cpu_threads": args.threads},
            "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": max(2048, args.prefill_len)},
            "logging": {"level": "warning", "stats_interval_s": 0},
        }
    )
    return EngineCore(config, phases=timer)


def run_profiles(h: StepRunner, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    h.add(4, args.context, args.profile_steps + 3)
    while any(r.num_output_tokens == 0 for r in h.core.scheduler.requests.values()):
        h.core.step()
    h.core.step()

    def decodes() -> None:
        for _ in range(args.profile_steps):
            h.core.step()

    table, wall, in_ops = profile_table(decodes, args.top)
    h.drain()
    out["decode b=4"] = {"table": table, "wall_s": wall, "in_ops_s": in_ops}
    if not args.prefill_reps:
        return out
    h.add(1, args.prefill_len, 1)
    table, wall, in_ops = profile_table(h.core.step, args.top)
    h.drain()
    out[f"prefill {args.prefill_len}"] = {"table": table, "wall_s": wall, "in_ops_s": in_ops}
    return out


def report(
    bw: dict[int, Bandwidth], gflops: dict[int, float], nbytes: int, times: list[StepTimes], threads: int
) -> None:
    print(f"\nroofline  (weights {nbytes / 1e9:.3f} GB)")
    for t, b in bw.items():
        bound = nbytes / (b.best * 1e9) * 1e3
        print(
            f"  {t} thread(s): copy {b.copy_gbs:6.1f} GB/s  triad {b.triad_gbs:6.1f} GB/s"
            f"  -> decode bound {bound:7.1f} ms/step;  fp32 GEMM {gflops[t]:6.1f} GFLOP/s"
        )
    print(f"\nengine steps  (torch threads {threads}; medians)")
    print(
        f"  {'case':<14}{'steps':>6}{'step ms':>10}{'forward ms':>12}{'host ms':>9}{'cpu ms':>9}{'x bound':>9}"
    )
    for s in times:
        print(
            f"  {s.case:<14}{s.steps:>6}{s.step_ms:>10.1f}{s.forward_ms:>12.1f}"
            f"{s.step_ms - s.forward_ms:>9.1f}{s.cpu_ms:>9.1f}{s.ratio:>9.2f}"
        )
    print("  (host: step minus forward; cpu: process CPU time, which other processes' load does not inflate;")
    print("   bound: decode = weight bytes / bandwidth, prefill = projection FLOPs / GEMM rate)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--model", default="builtin:tiny-qwen3.5", help="model folder or builtin:<name>")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--context", type=int, default=64, help="prompt tokens of each decoding sequence")
    p.add_argument("--decode-steps", type=int, default=10)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prefill-reps", type=int, default=3, help="0: no prefill case")
    p.add_argument("--profile-steps", type=int, default=3, help="decode steps in the profiler trace")
    p.add_argument("--top", type=int, default=15, help="rows of each op table")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler tables")
    p.add_argument("--cache-bytes", type=bytes_arg, default=1024**3, help="bytes or a size: 1GiB")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("warning")
    bench = Bench("profile_cpu", args)
    bw, gflops = {}, {}
    for t in sorted({1, args.threads}):
        torch.set_num_threads(t)
        bw[t] = measure_bandwidth()
        gflops[t] = measure_gemm_gflops()
    torch.set_num_threads(args.threads)
    timer = ForwardTimer()
    core = build_engine(args, timer)
    nbytes = weight_bytes(core.runner.model)
    bound_ms = nbytes / (bw[args.threads].best * 1e9) * 1e3
    h = StepRunner(core, timer)
    h.decode(1, args.context, 2)  # warm-up: allocator, first calls
    times = [h.decode(1, args.context, args.decode_steps), h.decode(4, args.context, args.decode_steps)]
    if args.prefill_reps:
        times.append(h.prefill(args.prefill_len, args.prefill_reps))
    for s in times:
        s.bound_ms = bound_ms
    if args.prefill_reps:
        flops = 2 * projection_params(core.runner.model) * args.prefill_len
        times[-1].bound_ms = max(bound_ms, flops / (gflops[args.threads] * 1e9) * 1e3)
    report(bw, gflops, nbytes, times, args.threads)
    profiles = {} if args.no_profile else run_profiles(h, args)
    for case, prof in profiles.items():
        outside = prof["wall_s"] - prof["in_ops_s"]
        print(f"\ntop ops: {case}  (wall {prof['wall_s'] * 1e3:.1f} ms, outside ops {outside * 1e3:.1f} ms)")
        print(prof["table"])
    print(describe_box(bench.before))
    data = {
        "threads": args.threads,
        "weight_bytes": nbytes,
        "bandwidth": {t: asdict(b) for t, b in bw.items()},
        "gemm_gflops": gflops,
        "bound_ms": bound_ms,
        "steps": [{**asdict(s), "ratio": s.ratio} for s in times],
    }
    bench.write(args.json, data)
    core.close()


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "profile_cpu")
