#!/usr/bin/env python
"""Host overhead per step: the real engine with the model's forward replaced by a null model.

Everything but the forward runs for real — scheduling, batch building, cache bookkeeping
(plan and commit), sampling, detokenizing, stop checks, outputs — so what is timed is the
CPU work that sits around every GPU step. On a GPU a decode step of a small hybrid model
takes a few milliseconds: this is the budget the host must stay within.

    python tools/bench/bench_overhead.py                       # 8 / 64 / 256 running decodes + a mixed step
    python tools/bench/bench_overhead.py --batch 256 --steps 300 --json out.json

Prints ms/step, µs per request per step and a breakdown (schedule, build batch, cache,
sample, detokenize, outputs, forward, other). The null model returns zero logits (greedy
picks token 0; EOS is ignored), so every request decodes to ``max_tokens``. Single-threaded
torch (``--threads``) so the numbers do not depend on the machine's core count.

Each case runs twice after the prefill: ``--steps`` steps untouched (only the forward
replaced), which give ms/step (median), then ``--steps`` more with every phase wrapped in a
timer, which give the breakdown (means; the timers' own cost lands in ``other``). ``forward``
is the null forward plus the state-slot copies around it (restores, decode-time tracking
copies): device work on a GPU, host work here. ``--set engine.async_scheduling=true`` times
the overlapped loop (its forward runs on a worker thread, so phases may overlap).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deltaserve.engine import EngineCore, SamplingParams
from deltaserve.engine.cli import add_config_args, config_from_args
from deltaserve.logs import configure_logging

PHASES = ("schedule", "build_batch", "cache", "sample", "detokenize", "outputs", "forward", "other")


class Timers:
    """Accumulates nanoseconds per phase; ``wrap`` times a callable into a phase."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.enabled = False

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            if not self.enabled:
                return fn(*a, **k)
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                self.ns[phase] += time.perf_counter_ns() - t0

        return timed

    def reset(self) -> None:
        self.ns = defaultdict(int)


def null_model(core: EngineCore) -> None:
    """Replace the forward by one that returns zero logits (the rest of the step stays real)."""
    vocab = core.vocab_size

    def null_forward(batch: Any, caches: Any) -> torch.Tensor:
        return torch.zeros(batch.logits_indices.numel(), vocab)

    core.runner.model.forward = null_forward  # type: ignore[method-assign]


def instrument(core: EngineCore, timers: Timers) -> None:
    """Time each phase of the step (the forward is already the null model)."""
    sched, cache, runner = core.scheduler, core.cache, core.runner
    sched.schedule = timers.wrap("schedule", sched.schedule)  # type: ignore[method-assign]
    # a runner names these phases prepare / _sample or build_batch / ops.sample: time whichever exists
    if hasattr(runner, "prepare"):
        runner.prepare = timers.wrap("build_batch", runner.prepare)  # type: ignore[method-assign]
    else:
        runner.build_batch = timers.wrap("build_batch", runner.build_batch)  # type: ignore[method-assign]
    if hasattr(runner, "_sample"):
        runner._sample = timers.wrap("sample", runner._sample)  # type: ignore[method-assign]
    else:
        runner.ops = type(runner.ops)(
            **{**runner.ops.__dict__, "sample": timers.wrap("sample", runner.ops.sample)}
        )
    runner.model.forward = timers.wrap("forward", runner.model.forward)  # type: ignore[method-assign]
    runner._copy_states = timers.wrap("forward", runner._copy_states)  # type: ignore[method-assign]
    cache.commit_step = timers.wrap("cache", cache.commit_step)  # type: ignore[method-assign]
    process = core.process_token
    core.process_token = timers.wrap("outputs", process)  # type: ignore[method-assign]
    # the scheduler calls plan_step inside schedule(): count it as cache, not schedule
    plan = cache.plan_step

    def plan_step(*a: Any, **k: Any) -> Any:
        if not timers.enabled:
            return plan(*a, **k)
        t0 = time.perf_counter_ns()
        try:
            return plan(*a, **k)
        finally:
            dt = time.perf_counter_ns() - t0
            timers.ns["cache"] += dt
            timers.ns["schedule"] -= dt

    cache.plan_step = plan_step  # type: ignore[method-assign]


def time_detokenize(core: EngineCore, timers: Timers) -> None:
    """Detokenize runs inside the outputs phase: split it out per request state."""
    for state in core.states.values():
        det = state.detokenizer
        if getattr(det, "_timed", False):
            continue
        add = det.add

        def timed_add(ids: list[int], _add: Callable[..., str] = add) -> str:
            if not timers.enabled:
                return _add(ids)
            t0 = time.perf_counter_ns()
            try:
                return _add(ids)
            finally:
                dt = time.perf_counter_ns() - t0
                timers.ns["detokenize"] += dt
                timers.ns["outputs"] -= dt

        det.add = timed_add  # type: ignore[method-assign]
        det._timed = True  # type: ignore[attr-defined]


def measure(core: EngineCore, batch: int, steps: int, *, mixed: bool, prompt_len: int) -> dict[str, Any]:
    null_model(core)
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(core.make_request([(7 * i + j) % 200 + 3 for j in range(prompt_len)], params))
    while any(not r.is_decoding for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # prefill everything first (instant: null model)
    if mixed:
        # half the requests go, the other half arrive as prompts: decodes + prefill chunks per step
        for rid in list(core.scheduler.requests)[: batch // 2]:
            core.abort_request(rid)
    timers = Timers()

    def run(offset: int) -> list[int]:
        per_step: list[int] = []
        for s in range(offset, offset + steps):
            if mixed and s % 4 == 0 and core.scheduler.num_waiting < 4:
                for j in range(2):
                    req = core.make_request(
                        [(s * 13 + j * 7 + k) % 200 + 3 for k in range(4 * prompt_len)], params
                    )
                    core.add_request(req)
                time_detokenize(core, timers)
            t0 = time.perf_counter_ns()
            core.step()
            per_step.append(time.perf_counter_ns() - t0)
            time_detokenize(core, timers)
        return per_step

    clean = run(0)  # ms/step: nothing wrapped
    running = len(core.scheduler.running)
    instrument(core, timers)
    time_detokenize(core, timers)
    timers.enabled = True
    timed = run(steps)  # the breakdown
    timers.enabled = False
    total = sum(timed)
    accounted = sum(v for k, v in timers.ns.items() if k != "other")
    timers.ns["other"] = total - accounted
    ms = statistics.median(clean) / 1e6
    return {
        "batch": batch,
        "mixed": mixed,
        "running": running,
        "steps": steps,
        "ms_per_step": round(ms, 4),
        "us_per_request_step": round(ms * 1000 / max(running, 1), 3),
        "ms_per_step_instrumented": round(statistics.median(timed) / 1e6, 4),
        "breakdown_us_per_step": {p: round(timers.ns[p] / steps / 1000, 1) for p in PHASES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_config_args(parser)
    parser.add_argument(
        "--batch", type=int, action="append", help="running decodes (repeatable; default 8 64 256)"
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed prefill + decode case")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    configure_logging("warning")
    torch.set_num_threads(args.threads)
    batches = args.batch or [8, 64, 256]
    cases = [(b, False) for b in batches] + ([] if args.no_mixed else [(max(batches), True)])
    results = []
    for batch, mixed in cases:
        config = config_from_args(
            args,
            {
                "scheduler.max_num_seqs": batch,
                "scheduler.max_num_batched_tokens": max(2048, batch),
                "cache.memory_bytes": 2 * 1024**3,
                "logging.stats_interval_s": 0,
                "logging.level": "warning",
            },
        )
        core = EngineCore(config)
        results.append(measure(core, batch, args.steps, mixed=mixed, prompt_len=args.prompt_len))
        if hasattr(core, "close"):
            core.close()  # the forward worker of async scheduling
        del core
    head = f"{'case':>14s} {'ms/step':>9s} {'us/req/step':>12s}  " + " ".join(f"{p:>11s}" for p in PHASES)
    print(head)
    for r in results:
        name = f"{r['running']} {'mixed' if r['mixed'] else 'decode'}"
        cols = " ".join(f"{r['breakdown_us_per_step'][p]:>11.1f}" for p in PHASES)
        print(f"{name:>14s} {r['ms_per_step']:>9.3f} {r['us_per_request_step']:>12.2f}  {cols}")
    print(
        "(ms/step: median, nothing wrapped; breakdown: microseconds per step, mean over as many timed steps)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"tool": "deltaserve.bench_overhead", "results": results}, indent=1)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "bench_overhead")
