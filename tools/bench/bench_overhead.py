#!/usr/bin/env python
"""Host overhead per step: the real engine with the model's forward replaced by a null model.

Everything but the forward runs for real — scheduling, batch building, cache bookkeeping
(plan and commit), sampling, stop checks, outputs — so what is timed is the CPU work that
sits around every GPU step. On a GPU a decode step of a small hybrid model takes a few
milliseconds: this is the budget the host must stay within.

    python tools/bench/bench_overhead.py                       # 8 / 64 / 256 running decodes + a mixed step
    python tools/bench/bench_overhead.py --batch 256 --steps 300 --json out.json

Prints ms/step, µs per request per step and a breakdown by phase. The null model returns zero
logits (greedy picks token 0; EOS is ignored), so every request decodes to ``max_tokens``.
Single-threaded torch (``--threads``) so the numbers do not depend on the machine's core count.

Only public hooks are used: the null model is handed to ``EngineCore`` as its ``loaded`` model
(the loaded model with ``NullModel`` in place of the model: same cache spec and weights, zero
logits), and the phases are read through ``EngineCore(phases=TimedPhases())``
(``engine/core/step_phases.py``). Each case builds two engines on the same weights and feeds
them the same requests: ``plain`` (the default, no-op recorder), which gives ms/step, and
``timed``, which gives the breakdown; their steps run as interleaved pairs
(``harness.interleaved``: plain, timed, then timed, plain, ...), so the recorder's own cost is
their difference. ``detokenize`` is the front end's ``IncrementalDetokenizer`` run by this
benchmark over each step's new token ids (wherever the engine runs it, that is its cost; it is
not in ms/step); ``other`` is the rest of the timed step (the recorder's own cost included).
``forward`` is the null forward plus the state-slot copies around it (device work on a GPU,
host work here). ``--set engine.async_scheduling=true`` times the overlapped loop (its forward
runs on a worker thread, so phases may overlap and ``other`` may go negative).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from deltaserve.engine import EngineCore, SamplingParams
from deltaserve.engine.cli import add_config_args, config_from_args
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.core.builder import resolve_device, resolve_dtype, resolve_ops
from deltaserve.engine.core.step_phases import PHASES, TimedPhases
from deltaserve.engine.front.detokenizer import IncrementalDetokenizer
from deltaserve.engine.outputs import RequestOutput
from deltaserve.logs import configure_logging
from deltaserve.models import LoadedModel, load_model
from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, interleaved, scaled, spread

COLUMNS = (*PHASES, "detokenize", "other")


class NullModel:
    """A loaded model whose forward returns zero logits; everything else (cache spec, weights,
    parameters) is the model's own. The model interface: ``models/decoder.py``."""

    def __init__(self, model: Any, vocab: int) -> None:
        self._model = model
        self._vocab = vocab

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, batch: Any, caches: Any) -> torch.Tensor:
        return torch.zeros(batch.logits_indices.numel(), self._vocab)


def null_loaded(config: EngineConfig) -> LoadedModel:
    """The configured model, loaded as the engine loads it, with ``NullModel`` as its model."""
    device = resolve_device(config)
    dtype = resolve_dtype(config.model.dtype, device)
    ops = resolve_ops(config, device)
    loaded = load_model(
        config.model.path, dtype=dtype, device=device, ops=ops, tokenizer=config.model.tokenizer
    )
    return dataclasses.replace(loaded, model=NullModel(loaded.model, int(loaded.hf_config.vocab_size)))


class Driver:
    """One engine fed the case's requests, step by step; it detokenizes its outputs itself."""

    def __init__(self, core: EngineCore, batch: int, *, mixed: bool, prompt_len: int) -> None:
        self.core, self.mixed, self.prompt_len = core, mixed, prompt_len
        self.params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.detok_ns = 0
        self.step_index = 0
        for i in range(batch):
            self.add([(7 * i + j) % 200 + 3 for j in range(prompt_len)])
        while any(not r.is_decoding for r in core.scheduler.running) or core.scheduler.waiting:
            self.detokenize(core.step())  # prefill everything first (instant: null model)
        if mixed:
            # half the requests go, the other half arrive as prompts: decodes + prefill chunks per step
            for rid in list(core.scheduler.requests)[: batch // 2]:
                core.abort_request(rid)

    def add(self, prompt: list[int]) -> None:
        req = self.core.make_request(prompt, self.params)
        self.detok[req.request_id] = IncrementalDetokenizer(self.core.tokenizer, [])
        self.core.add_request(req)

    def detokenize(self, outputs: list[RequestOutput]) -> None:
        t0 = time.perf_counter_ns()
        for out in outputs:
            det = self.detok.get(out.request_id)
            if det is not None and out.token_ids:
                det.add(list(out.token_ids))
        self.detok_ns += time.perf_counter_ns() - t0

    def step(self) -> float:
        """One step (new prompts first in the mixed case): its seconds, detokenizing not included."""
        s = self.step_index
        self.step_index += 1
        if self.mixed and s % 4 == 0 and self.core.scheduler.num_waiting < 4:
            for j in range(2):
                self.add([(s * 13 + j * 7 + k) % 200 + 3 for k in range(4 * self.prompt_len)])
        t0 = time.perf_counter()
        outputs = self.core.step()
        seconds = time.perf_counter() - t0
        self.detokenize(outputs)
        return seconds


def measure(
    config: EngineConfig, loaded: LoadedModel, batch: int, steps: int, *, mixed: bool, prompt_len: int
) -> dict[str, Any]:
    recorder = TimedPhases()
    plain = Driver(EngineCore(config, loaded=loaded), batch, mixed=mixed, prompt_len=prompt_len)
    timed = Driver(
        EngineCore(config, loaded=loaded, phases=recorder), batch, mixed=mixed, prompt_len=prompt_len
    )
    recorder.reset()
    timed.detok_ns = 0
    running = len(plain.core.scheduler.running)
    times = interleaved({"plain": plain.step, "timed": timed.step}, steps)
    for d in (plain, timed):
        d.core.close()  # (the forward worker of async scheduling)
    total_ns = sum(times["timed"]) * 1e9
    breakdown = {p: recorder.ns[p] for p in PHASES}
    breakdown["detokenize"] = timed.detok_ns
    breakdown["other"] = int(total_ns - sum(recorder.ns[p] for p in PHASES))
    ms = scaled(spread(times["plain"]), 1e3, 4)
    return {
        "batch": batch,
        "mixed": mixed,
        "running": running,
        "steps": steps,
        "ms_per_step": ms["median"],
        "us_per_request_step": round(ms["median"] * 1000 / max(running, 1), 3),
        "ms_per_step_spread": ms,
        "ms_per_step_instrumented": scaled(spread(times["timed"]), 1e3, 4)["median"],
        "breakdown_us_per_step": {p: round(ns / steps / 1000, 1) for p, ns in breakdown.items()},
    }


def main() -> None:
    parser = bench_parser(__doc__)
    add_config_args(parser)
    parser.add_argument(
        "--batch", type=int, action="append", help="running decodes (repeatable; default 8 64 256)"
    )
    parser.add_argument("--steps", type=int, default=200, help="interleaved pairs of steps per case")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed prefill + decode case")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    configure_logging("warning")
    torch.set_num_threads(args.threads)
    bench = Bench("bench_overhead", args)
    batches = args.batch or [8, 64, 256]
    cases = [(b, False) for b in batches] + ([] if args.no_mixed else [(max(batches), True)])
    results = []
    loaded: LoadedModel | None = None
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
        loaded = loaded or null_loaded(config)  # (the model settings are the same in every case)
        results.append(measure(config, loaded, batch, args.steps, mixed=mixed, prompt_len=args.prompt_len))
    head = f"{'case':>14s} {'ms/step':>9s} {'us/req/step':>12s} {'timed':>7s}  " + " ".join(
        f"{p:>12s}" for p in COLUMNS
    )
    print(head)
    for r in results:
        name = f"{r['running']} {'mixed' if r['mixed'] else 'decode'}"
        cols = " ".join(f"{r['breakdown_us_per_step'][p]:>12.1f}" for p in COLUMNS)
        print(
            f"{name:>14s} {r['ms_per_step']:>9.3f} {r['us_per_request_step']:>12.2f}"
            f" {r['ms_per_step_instrumented']:>7.3f}  {cols}"
        )
    print(
        "(ms/step: median of the plain engine's steps; timed: the same with the phases recorded; breakdown:"
        " microseconds per step, mean over the timed engine's steps, interleaved with the plain one's)"
    )
    print(describe_box(bench.before))
    bench.write(args.json, results)


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "bench_overhead")
