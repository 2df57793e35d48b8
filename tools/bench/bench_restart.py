#!/usr/bin/env python
"""Turn N+1 of a conversation after a restart: time to first token, cold vs disk-warm.

    python tools/bench/bench_restart.py                                   # the built-in tiny model
    python tools/bench/bench_restart.py --model /tmp/q08 --prefix-len 2000 --conversations 3

One run: an engine with a disk tier serves turn 1 of ``--conversations`` conversations (one
at a time) and is closed (what the disk lacks is written, the store flushed), as a server is
on a deploy. Then turn 2 (turn 1 + its answer + a new user message) is served one request at
a time by (a) a fresh engine without a disk tier — a restart today: every prompt is computed
— and (b) a fresh engine on the same disk path (sharing (a)'s weights), the two as interleaved
pairs (``harness.interleaved``: conversation i on (a) and on (b), the order alternating).
Prints each one's TTFT (median with min-max, and per request), the tokens served from disk,
and checks that the greedy outputs are equal.
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deltaserve.engine import EngineConfig, EngineCore, SamplingParams
from deltaserve.logs import get_logger
from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, interleaved, scaled, spread

log = get_logger("deltaserve.tools")


def _engine(args: argparse.Namespace, disk: Path | None, loaded: Any = None) -> EngineCore:
    dotted: dict[str, Any] = {
        "model.path": args.model,
        "cache.memory_bytes": args.memory_mb * 2**20,
        "scheduler.max_num_seqs": 4,
        "scheduler.max_num_batched_tokens": args.batched_tokens,
        "logging.stats_interval_s": 0.0,
    }
    if disk is not None:
        dotted["cache.disk_path"] = str(disk)
        dotted["cache.disk_write_bytes_per_s"] = None
    return EngineCore(EngineConfig.load(None, dotted), loaded=loaded)


def _serve_one(core: EngineCore, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """TTFT (seconds) and the greedy output of one request served alone."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = core.make_request(prompt, params)
    start = time.perf_counter()
    core.add_request(req)
    ttft, tokens = 0.0, []
    while core.has_work():
        for out in core.step():
            if out.request_id == req.request_id:
                if not tokens and out.token_ids:
                    ttft = time.perf_counter() - start
                tokens += out.token_ids
    return ttft, tokens


def _turn(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    ttfts, outs = [], []
    for p in prompts:
        t, o = _serve_one(core, p, max_tokens)
        ttfts.append(t)
        outs.append(o)
    return ttfts, outs


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    vocab = 1000
    turn1 = [
        [rng.randrange(3, vocab) for _ in range(args.prefix_len + 40 * i)] for i in range(args.conversations)
    ]
    root = Path(tempfile.mkdtemp(prefix="deltaserve-restart-"))
    try:
        first = _engine(args, root / "store")
        _, answers = _turn(first, turn1, args.output_len)
        first.close()
        del first  # one model in memory at a time
        gc.collect()
        turn2 = [
            c + a + [rng.randrange(3, vocab) for _ in range(args.user_len)]
            for c, a in zip(turn1, answers, strict=True)
        ]
        cold = _engine(args, None)
        warm = _engine(args, root / "store", loaded=cold.loaded)
        opened = warm.disk.store.describe() if warm.disk is not None else {}
        outs: dict[str, list[list[int]]] = {"cold": [], "disk_warm": []}

        def serve(name: str, core: EngineCore) -> Callable[[], float]:
            prompts = iter(turn2)

            def one() -> float:
                ttft, out = _serve_one(core, next(prompts), args.output_len)
                outs[name].append(out)
                return ttft

            return one

        ttfts = interleaved({"cold": serve("cold", cold), "disk_warm": serve("disk_warm", warm)}, len(turn2))
        cold_ttft, warm_ttft = ttfts["cold"], ttfts["disk_warm"]
        stats = warm.stats()
        warm.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert outs["disk_warm"] == outs["cold"], "a disk hit changed a greedy output"
    result = {
        "model": args.model,
        "prompt_tokens": [len(p) for p in turn2],
        "cold_ttft_ms": [round(1000 * t, 1) for t in cold_ttft],
        "disk_warm_ttft_ms": [round(1000 * t, 1) for t in warm_ttft],
        "cold_ttft_median_ms": round(1000 * spread(cold_ttft)["median"], 1),
        "disk_warm_ttft_median_ms": round(1000 * spread(warm_ttft)["median"], 1),
        "cold_ttft_spread_ms": scaled(spread(cold_ttft), 1000, 1),
        "disk_warm_ttft_spread_ms": scaled(spread(warm_ttft), 1000, 1),
        "hit_tokens_disk": stats["prefix_cache.hit_tokens_disk"],
        "query_tokens": stats["prefix_cache.query_tokens"],
        "disk_read_wait_ms": stats["disk.read_wait_ms"],
        "store_opened": {k: opened.get(k) for k in ("items", "bytes", "opened_in_ms")},
    }
    result["speedup"] = round(
        result["cold_ttft_median_ms"] / max(result["disk_warm_ttft_median_ms"], 1e-3), 2
    )
    return result


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__)
    p.add_argument("--model", default="builtin:tiny-qwen3.5")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument(
        "--prefix-len", type=int, default=1500, help="turn 1's prompt tokens (the first conversation)"
    )
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--user-len", type=int, default=40, help="turn 2's new user tokens")
    p.add_argument("--memory-mb", type=int, default=1024)
    p.add_argument("--batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p


def main() -> None:
    args = build_parser().parse_args()
    bench = Bench("bench_restart", args)
    result = run(args)
    for key, value in result.items():
        print(f"{key}: {value}")
    print(describe_box(bench.before))
    bench.write(args.json, result)


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "bench_restart")
