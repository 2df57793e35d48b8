"""Speculative decoding's ceiling: the replay drafter (acceptance 100 %) and its half-corrupted
variant (every other draft wrong: two tokens per verify) against speculation off.

``--streams`` greedy requests decode together (EOS ignored, ``--max-tokens`` each), on random
prompts of ``--prompt-len`` tokens, new ones every round (so no case gets another's prefix
hits). A reference run with speculation off first produces every round's outputs; the replay
cases are seeded with them, and every case's outputs must equal them (the bench fails if not).
Cases run in interleaved rounds (``tools/bench/harness.py``). Per case:

* ``itl_ms``: per output token, the wait for the delta that brought it spread over that delta's
  tokens (a verify that emits 4 tokens after 200 ms gives each 50 ms): the time per token a
  stream sees. (Loadgen's ITL counts the gaps inside one delta as 0.)
* ``gap_ms``: between two deltas of a stream (one engine step).
* ``tok_s``: output tokens per second over all streams.

``--async-scheduling`` adds each case again with ``engine.async_scheduling = true``.

    python tools/bench/bench_spec.py [--model PATH] [--streams 4] [--k 3] [--rounds 3] [--async-scheduling]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from deltaserve.engine import EngineConfig, EngineCore, SamplingParams
from deltaserve.engine.spec.replay import ReplayDrafter
from deltaserve.logs import configure_logging
from deltaserve.models import LoadedModel
from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, interleaved, spread


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__, rounds=3)
    p.add_argument("--model", default="builtin:tiny-qwen3.5", help="builtin:<name> or a model folder")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--k", type=int, default=3, help="speculative.num_tokens")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--memory", default="512MiB", help="cache.memory_bytes (of each of the four engines)")
    p.add_argument("--threads", type=int, default=0, help="engine.cpu_threads")
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="also run each case with engine.async_scheduling = true (a verify step is not overlapped)",
    )
    return p


def run(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Serve ``prompts`` at once; outputs, per-token ITLs, delta gaps, output tokens/s."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [core.make_request(p, params) for p in prompts]
    t0 = time.perf_counter()
    for r in reqs:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    last: dict[str, float] = {}
    itl: list[float] = []
    gaps: list[float] = []
    while core.has_work():
        outs = core.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in last and out.token_ids:
                gap = now - last[out.request_id]
                gaps.append(gap)
                itl += [gap / len(out.token_ids)] * len(out.token_ids)
            if out.token_ids:
                last[out.request_id] = now
            tokens[out.request_id].extend(out.token_ids)
    wall = time.perf_counter() - t0
    outputs = [tokens[r.request_id] for r in reqs]
    return {"outputs": outputs, "itl": itl, "gaps": gaps, "tok_s": sum(map(len, outputs)) / wall}


def main() -> None:
    args = build_parser().parse_args()
    configure_logging("warning")
    base = {
        "model.path": args.model,
        "model.device": "cpu",
        "cache.memory_bytes": args.memory,
        "engine.cpu_threads": args.threads,
        "scheduler.max_num_seqs": max(args.streams, 1),
        "logging.stats_interval_s": 0.0,
        "logging.level": "warning",
    }
    ref = EngineCore(EngineConfig.load(None, base))
    loaded: LoadedModel = ref.loaded
    vocab = ref.vocab_size
    rng = random.Random(0)
    rounds = [
        [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]
        for _ in range(args.rounds + 1)  # + the warm-up round
    ]
    expected = [run(ref, prompts, args.max_tokens)["outputs"] for prompts in rounds]
    spec = {"speculative.method": "replay", "speculative.num_tokens": args.k}
    cores = {
        "off": EngineCore(EngineConfig.load(None, base), loaded=loaded),
        f"replay k={args.k}": EngineCore(EngineConfig.load(None, {**base, **spec}), loaded=loaded),
        f"replay k={args.k}, every other draft wrong": EngineCore(
            EngineConfig.load(None, {**base, **spec, "speculative.replay_corrupt_every": 2}), loaded=loaded
        ),
    }
    if args.async_scheduling:
        for name in list(cores):
            cfg = cores[name].config.replace(**{"engine.async_scheduling": True})
            cores[f"{name}, async"] = EngineCore(cfg, loaded=loaded)
    for core in cores.values():
        if core.speculation is not None:
            drafter = core.speculation.drafter
            assert isinstance(drafter, ReplayDrafter)
            for prompts, outs in zip(rounds, expected, strict=True):
                for p, o in zip(prompts, outs, strict=True):
                    drafter.record(p, o)
    bench = Bench("bench_spec", args)
    results: dict[str, dict[str, list[Any]]] = {name: {"itl": [], "gaps": [], "tok_s": []} for name in cores}
    calls = dict.fromkeys(cores, 0)

    def case(name: str) -> Any:
        def go() -> float:
            r = calls[name]
            calls[name] += 1
            res = run(cores[name], rounds[r], args.max_tokens)
            if res["outputs"] != expected[r]:
                raise SystemExit(f"{name}: outputs differ from speculation off in round {r}")
            if r > 0:  # round 0 is the warm-up
                for key in ("itl", "gaps", "tok_s"):
                    results[name][key].append(res[key])
            return res["tok_s"]

        return go

    interleaved({name: case(name) for name in cores}, args.rounds, warmup=1)
    rows: dict[str, Any] = {}
    off_itl = statistics.median([x for r in results["off"]["itl"] for x in r])
    print(describe_box(bench.before))
    print(f"{'case':<44} {'ITL p50 ms':>10} {'/off':>6} {'gap p50 ms':>10} {'tok/s':>8} {'accept':>7}")
    for name, core in cores.items():
        itl = [x for r in results[name]["itl"] for x in r]
        gaps = [x for r in results[name]["gaps"] for x in r]
        s = core.stats()
        rows[name] = {
            "itl_ms": {k: (v if k == "n" else v * 1000) for k, v in spread(itl).items()},
            "gap_ms": {k: (v if k == "n" else v * 1000) for k, v in spread(gaps).items()},
            "tok_s": spread(results[name]["tok_s"]),
            "acceptance_rate": s.get("spec_decode.acceptance_rate"),
            "tokens_per_verify": s.get("spec_decode.mean_tokens_per_verify"),
        }
        acc = rows[name]["acceptance_rate"]
        print(
            f"{name:<44} {rows[name]['itl_ms']['median']:>10.1f} {statistics.median(itl) / off_itl:>6.2f} "
            f"{rows[name]['gap_ms']['median']:>10.1f} {rows[name]['tok_s']['median']:>8.1f} "
            f"{'-' if acc is None else f'{acc * 100:.0f}%':>7}"
        )
    bench.write(args.json, rows)


if __name__ == "__main__":
    main()
