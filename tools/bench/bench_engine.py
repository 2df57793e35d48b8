"""Engine throughput against transformers `generate`, same model, same run.

Two workloads, each timed for both sides:

* ``mixed``: N prompts of mixed lengths. transformers runs them one at a time (an
  application without a serving engine); the engine gets them all at once.
* ``static``: a static batch of N equal-length prompts; transformers `generate` on the
  whole batch, the engine with all N submitted together.

Greedy decoding, EOS ignored, so both sides produce exactly ``max_tokens`` per request
(the output tokens are also compared: they must be identical). Prints output tokens/s and
the engine ÷ transformers ratios.

    python tools/bench/bench_engine.py [--num 32] [--max-tokens 32] [--config FILE] [--set k=v]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from deltaserve.engine import EngineCore, SamplingParams
from deltaserve.engine.cli import add_config_args, config_from_args
from deltaserve.logs import configure_logging
from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, interleaved, show, spread


def run_engine(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [core.make_request(p, params) for p in prompts]
    t0 = time.perf_counter()
    for r in reqs:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id].extend(out.token_ids)
    return time.perf_counter() - t0, [tokens[r.request_id] for r in reqs]


def hf_generate(model: object, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    ids = torch.tensor(batch)
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :].tolist()


def build_parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__)
    add_config_args(ap)
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--static-len", type=int, default=128)
    ap.add_argument("--mixed-min", type=int, default=16)
    ap.add_argument("--mixed-max", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat", type=int, default=3, help="interleaved rounds of the four runs; medians are reported"
    )
    return ap


def _prompts(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """``--num`` prompts of mixed lengths, and ``--num`` of ``--static-len`` tokens."""
    rng = random.Random(args.seed)
    mixed = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(args.mixed_min, args.mixed_max))]
        for _ in range(args.num)
    ]
    static = [[rng.randrange(3, vocab) for _ in range(args.static_len)] for _ in range(args.num)]
    return mixed, static


def _timed(
    core: EngineCore, hf: Any, mixed: list[list[int]], static: list[list[int]], args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Seconds per repetition of each side and workload, and the last repetition's outputs.

    The sides run as interleaved pairs (``harness.interleaved``): load from other processes on a
    shared machine then hits both sides alike instead of skewing one ratio."""
    outputs: dict[str, list[list[int]]] = {}

    def hf_mixed() -> None:
        outputs["hf_mixed"] = [hf_generate(hf, [p], args.max_tokens)[0] for p in mixed]

    def eng_mixed() -> float:
        t, outputs["eng_mixed"] = run_engine(core, mixed, args.max_tokens)
        return t

    def hf_static() -> None:
        outputs["hf_static"] = hf_generate(hf, static, args.max_tokens)

    def eng_static() -> float:
        t, outputs["eng_static"] = run_engine(core, static, args.max_tokens)
        return t

    cases = {"hf_mixed": hf_mixed, "eng_mixed": eng_mixed, "hf_static": hf_static, "eng_static": eng_static}
    return interleaved(cases, args.repeat), outputs


def main() -> None:
    args = build_parser().parse_args()
    configure_logging("warning")
    bench = Bench("bench_engine", args)
    # Prefix caching off: repetitions must not turn into cache hits (this measures batching).
    base = {
        "scheduler.max_num_seqs": max(args.num, 8),
        "model.dtype": "float32",
        "cache.enable_prefix_caching": False,
    }
    config = config_from_args(args, base)
    core = EngineCore(config)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(core.loaded.path, dtype=torch.float32).eval()
    mixed, static = _prompts(args, int(core.loaded.hf_config.vocab_size))
    n_out = args.num * args.max_tokens

    # warm-up both sides (allocator, first-call overheads)
    run_engine(core, mixed[:2], 4)
    hf_generate(hf, [mixed[0]], 4)

    times, outputs = _timed(core, hf, mixed, static, args)
    s = {name: spread(t) for name, t in times.items()}
    results: dict[str, Any] = {
        "mixed": {
            "hf_one_at_a_time_tok_s": n_out / s["hf_mixed"]["median"],
            "engine_tok_s": n_out / s["eng_mixed"]["median"],
        },
        "static": {
            "hf_static_batch_tok_s": n_out / s["hf_static"]["median"],
            "engine_tok_s": n_out / s["eng_static"]["median"],
        },
        "seconds": s,
    }
    same_mixed = sum(a == b for a, b in zip(outputs["hf_mixed"], outputs["eng_mixed"], strict=True))
    same_static = sum(a == b for a, b in zip(outputs["hf_static"], outputs["eng_static"], strict=True))
    print(
        f"\nmodel {core.loaded.path.name}  prompts {args.num}  max_tokens {args.max_tokens}  threads {torch.get_num_threads()}"
    )
    print(f"{'workload':<10}{'transformers tok/s':>20}{'engine tok/s':>15}{'ratio':>8}{'identical':>11}")
    r = results["mixed"]
    print(
        f"{'mixed':<10}{r['hf_one_at_a_time_tok_s']:>20.1f}{r['engine_tok_s']:>15.1f}"
        f"{r['engine_tok_s'] / r['hf_one_at_a_time_tok_s']:>7.2f}x{same_mixed:>8}/{args.num}"
    )
    r = results["static"]
    print(
        f"{'static':<10}{r['hf_static_batch_tok_s']:>20.1f}{r['engine_tok_s']:>15.1f}"
        f"{r['engine_tok_s'] / r['hf_static_batch_tok_s']:>7.2f}x{same_static:>8}/{args.num}"
    )
    print("(mixed: transformers one request at a time; static: transformers one static batch)")
    print(f"(medians of {args.repeat} interleaved rounds; seconds min-max: ", end="")
    print(", ".join(f"{name} {show(v)}" for name, v in s.items()) + ")")
    print(describe_box(bench.before))
    bench.write(args.json, results)


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "bench_engine")
