#!/usr/bin/env python
"""The cost of a GDN checkpoint capture off the chunked kernel's 64-token grid.

    python tools/bench/bench_gdn_capture.py [--tokens 512 2048] [--threads 1] [--reps 7] [--json out.json]

Runs the reference ``chunk_gated_delta_rule`` (the CPU path) on one segment of the
Qwen3.5-0.8B GDN shape (16 key / 16 value heads of dim 128) with no capture, a capture on the
grid (the last chunk boundary before the end) and one off it (the last block boundary off the
grid: padded to the next chunk boundary by ``kernels/capture_align.py``), as interleaved rounds
(``harness.interleaved``), and prints the median time per layer of each (min-max) and its
ratio to no capture. glibc keeps freed blocks as the engine
does on the CPU (``engine.memory.keep_freed_memory``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deltaserve.engine.runner.memory import keep_freed_memory
from deltaserve.kernels.gdn import chunk_gated_delta_rule
from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, interleaved, spread

HEADS, DIM = 16, 128


def time_cases(tokens: int, reps: int) -> dict[str, dict[str, float]]:
    """Seconds per call of each capture case on a ``tokens``-token segment (``spread``)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, HEADS, DIM, generator=gen) for _ in range(3))
    g = -torch.rand(tokens, HEADS, generator=gen) * 0.3
    beta = torch.rand(tokens, HEADS, generator=gen)
    cu, ssm = torch.tensor([0, tokens]), torch.zeros(2, HEADS, DIM, DIM)
    slot, no = torch.tensor([0]), torch.tensor([False])
    on_grid = (tokens - 1) // 64 * 64  # the last chunk boundary before the end
    off_grid = next(b for b in range(tokens - 16, 0, -16) if b % 64)  # the last block boundary off it
    cases = {"none": None, f"on-grid {on_grid}": on_grid, f"off-grid {off_grid}": off_grid}

    def run(pos: int | None) -> None:
        cap: dict[str, Any] = {}
        if pos is not None:
            cap = {
                "capture_seq": slot,
                "capture_pos": torch.tensor([pos]),
                "capture_slots": torch.tensor([1]),
            }
        chunk_gated_delta_rule(q, k, v, g, beta, cu, ssm, slot, no, **cap)

    # (one warm-up round: first-touch pages, kernel caches)
    times = interleaved({c: lambda pos=pos: run(pos) for c, pos in cases.items()}, reps, warmup=1)
    return {case: spread(t) for case, t in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7, help="interleaved rounds")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = Bench("bench_gdn_capture", args)
    keep_freed_memory()
    results = []
    for tokens in args.tokens:
        cases = time_cases(tokens, args.reps)
        base = cases["none"]["median"]
        for case, t in cases.items():
            print(
                f"T={tokens:5d}  capture {case:>15}: {t['median'] * 1000:8.1f} ms per layer"
                f"  ({t['median'] / base:.3f}x; {t['min'] * 1000:.1f}-{t['max'] * 1000:.1f} ms)"
            )
            results.append({"tokens": tokens, "case": case, "seconds": t, "vs_none": t["median"] / base})
    print(describe_box(bench.before))
    bench.write(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
