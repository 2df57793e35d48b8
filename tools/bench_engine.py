"""Engine throughput against transformers `generate`, same model, same run.

Two workloads, each timed for both sides:

* ``mixed``: N prompts of mixed lengths. transformers runs them one at a time (an
  application without a serving engine); the engine gets them all at once.
* ``static``: a static batch of N equal-length prompts; transformers `generate` on the
  whole batch, the engine with all N submitted together.

Greedy decoding, EOS ignored, so both sides produce exactly ``max_tokens`` per request
(the output tokens are also compared: they must be identical). Prints output tokens/s and
the engine ÷ transformers ratios.

    python tools/bench_engine.py [--num 32] [--max-tokens 32] [--config FILE] [--set k=v]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from deltaserve.engine import EngineCore, SamplingParams
from deltaserve.engine.cli import add_config_args, config_from_args
from deltaserve.logs import configure_logging


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap)
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--static-len", type=int, default=128)
    ap.add_argument("--mixed-min", type=int, default=16)
    ap.add_argument("--mixed-max", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="alternating repetitions; medians are reported")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    configure_logging("warning")
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
    vocab = int(core.loaded.hf_config.vocab_size)
    rng = random.Random(args.seed)
    mixed = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(args.mixed_min, args.mixed_max))]
        for _ in range(args.num)
    ]
    static = [[rng.randrange(3, vocab) for _ in range(args.static_len)] for _ in range(args.num)]
    n_out = args.num * args.max_tokens
    results: dict[str, dict[str, float]] = {}

    # warm-up both sides (allocator, first-call overheads)
    run_engine(core, mixed[:2], 4)
    hf_generate(hf, [mixed[0]], 4)

    # Alternate the sides and keep each one's median: load from other processes on a shared
    # machine then hits both sides alike instead of skewing one ratio.
    t_hf_mixed_all, t_eng_mixed_all, t_hf_static_all, t_eng_static_all = [], [], [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        hf_mixed = [hf_generate(hf, [p], args.max_tokens)[0] for p in mixed]
        t_hf_mixed_all.append(time.perf_counter() - t0)
        t, eng_mixed = run_engine(core, mixed, args.max_tokens)
        t_eng_mixed_all.append(t)
        t0 = time.perf_counter()
        hf_static = hf_generate(hf, static, args.max_tokens)
        t_hf_static_all.append(time.perf_counter() - t0)
        t, eng_static = run_engine(core, static, args.max_tokens)
        t_eng_static_all.append(t)
    med = statistics.median
    results["mixed"] = {
        "hf_one_at_a_time_tok_s": n_out / med(t_hf_mixed_all),
        "engine_tok_s": n_out / med(t_eng_mixed_all),
    }
    results["static"] = {
        "hf_static_batch_tok_s": n_out / med(t_hf_static_all),
        "engine_tok_s": n_out / med(t_eng_static_all),
    }

    same_mixed = sum(a == b for a, b in zip(hf_mixed, eng_mixed, strict=True))
    same_static = sum(a == b for a, b in zip(hf_static, eng_static, strict=True))
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
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
