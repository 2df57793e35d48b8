"""Prefix-cache benefit on a multi-turn chat, measured against the ideal in the same run.

One conversation of ``--turns`` turns grows past ``--target-tokens`` of context; each turn's
prompt is the chat-template rendering of the whole history (including the replies the
engine generated). For every turn the same prompt is timed twice:

* **warm**: on the engine that served the previous turns (prefix cache on);
* **cold**: on a second engine with the prefix cache off.

TTFT ratio warm ÷ cold is printed beside the ideal ratio, uncached ÷ all prompt tokens
(what a perfect cache with zero overhead would give), plus the token hit rate, checkpoint
memory, skips and evictions.

    python tools/bench/bench_prefix_cache.py [--turns 10] [--user-tokens 220] [--reply-tokens 48]

``--pressure``: memory pressure. ``--conversations`` conversations, more than
the pools hold (``--checkpoint-slots`` checkpoints, KV for about ``--kv-conversations`` of
them), take turns round-robin; odd ones re-send the model's reply verbatim, even ones a
rewritten one (its leading 70 % stripped, like a client that drops reasoning). The same
prompts go, one at a time, to one engine per ``--policies`` entry (``cache.checkpoint_policy``:
the value model ``default`` and the simpler ``v1``) and to a cache-off engine: per policy,
the token hit rate and warm TTFT (turns after the first) beside cold TTFT, measured in the
same run; outputs must equal the cache-off ones.

    python tools/bench/bench_prefix_cache.py --pressure [--conversations 8] [--checkpoint-slots 3]

``--pressure --host``: the host tier. Two more engines see the same prompts:
``host`` (the first policy with the same device pools plus a host tier that holds every
conversation) and ``all-device`` (device pools that hold every conversation: the ideal the
host tier is measured against). ``--kv-conversations 2 --checkpoint-slots 2`` with the
default 8 conversations leaves the device a quarter of the working set.

``--pressure --one-budget``: one more engine, ``one-budget``: the first policy with the same
bytes as the fixed pools (live slots, KV and checkpoints) as one budget of pages that the
cache trades between KV and checkpoints by value (docs/cache.md, "One budget").
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from deltaserve.cache.arena import blocks_per_page
from deltaserve.engine import EngineCore, SamplingParams
from deltaserve.engine.cli import add_config_args, config_from_args
from deltaserve.logs import configure_logging
from deltaserve.tools.bench.harness import Bench, bench_parser, describe_box, interleaved, spread

WORDS = (
    "cache state model token prefix turn reply agent tool result query answer memory block "
    "checkpoint layer attention delta gate value key hybrid linear schedule batch stream user"
).split()


def ttft(core: EngineCore, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """Seconds to the first token, the generated tokens, and num_cached_tokens."""
    req = core.make_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    core.add_request(req)
    first = None
    tokens: list[int] = []
    cached = 0
    while core.has_work():
        for out in core.step():
            if first is None and out.token_ids:
                first = time.perf_counter() - t0
            tokens.extend(out.token_ids)
            cached = out.num_cached_tokens
    assert first is not None
    return first, tokens, cached


def _pressure_variants(
    args: argparse.Namespace, probe: EngineCore, final_len: int, kv_blocks: int
) -> dict[str, dict[str, object]]:
    """Config overrides per warm engine: one per policy at the same pools; with ``--host`` also
    the first policy plus a host tier holding every conversation, and the all-device ideal."""
    state_bytes = probe.cache.config.checkpoint_bytes
    pools = {
        "cache.checkpoint_pool_bytes": args.checkpoint_slots * state_bytes,
        "cache.num_kv_blocks": kv_blocks,
    }
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    variants: dict[str, dict[str, object]] = {p: {**pools, "cache.checkpoint_policy": p} for p in policies}
    if args.one_budget:  # the same bytes as the fixed pools, as one budget of pages
        # (requests run one at a time here: 8 live slots, so the cache's bytes are exactly the
        # fixed pools' and the live slots' cap of half the budget does not move any)
        block = probe.capacity.kv_block_bytes
        page = blocks_per_page(state_bytes, block) * block
        cache_bytes = kv_blocks * block + args.checkpoint_slots * state_bytes
        variants["one-budget"] = {"cache.checkpoint_policy": policies[0], "cache.num_kv_blocks": None,
                                  "scheduler.max_num_seqs": 8, "cache.memory_bytes": 8 * page + cache_bytes}  # fmt: skip
    if args.host:  # room for every conversation (and its older turns) on the host / on the device
        every_block = 2 * args.conversations * final_len // 16
        every_ckpt = 4 * args.conversations * args.turns
        variants["host"] = {**variants[policies[0]],
                            "cache.host_kv_cache_bytes": every_block * probe.capacity.kv_block_bytes,
                            "cache.host_checkpoint_pool_bytes": every_ckpt * state_bytes}  # fmt: skip
        variants["all-device"] = {"cache.checkpoint_policy": policies[0], "cache.num_kv_blocks": every_block,
                                  "cache.checkpoint_pool_bytes": every_ckpt * state_bytes}  # fmt: skip
    return variants


def _pressure_rows(
    args: argparse.Namespace, warm: dict[str, EngineCore], cold: EngineCore, system: str, rng: random.Random
) -> list[dict[str, object]]:
    """Every turn of every conversation, round-robin, through the cold engine and each warm one."""
    tok = cold.tokenizer
    convs = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    rows: list[dict[str, object]] = []
    for turn in range(args.turns):
        for c, messages in enumerate(convs):
            messages.append(
                {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(args.user_tokens))}
            )
            prompt = tok.encode(
                tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
            t_cold, reply, _ = ttft(cold, prompt, args.reply_tokens)
            row: dict[str, object] = {
                "turn": turn,
                "conversation": c,
                "prompt_tokens": len(prompt),
                "ttft_cold_s": t_cold,
            }
            for p, core in warm.items():
                t, out, cached = ttft(core, prompt, args.reply_tokens)
                assert out == reply, f"{p}: conversation {c} turn {turn}: a cache hit changed the output"
                row[f"{p}.ttft_s"], row[f"{p}.cached"] = t, cached
            rows.append(row)
            text = tok.decode(reply, skip_special_tokens=True)
            if c % 2 == 0:  # a client that strips the reasoning before re-sending
                words = text.split()
                text = " ".join(words[len(words) * 7 // 10 :])
            messages.append({"role": "assistant", "content": text})
    return rows


def _pressure_summary(
    rows: list[dict[str, object]], warm: dict[str, EngineCore], cold_ms: float
) -> dict[str, object]:
    """Per warm engine over the warm turns: hit rate, warm TTFT, counters; printed as a table."""
    warm_rows = [r for r in rows if r["turn"]]
    q = sum(int(r["prompt_tokens"]) for r in warm_rows)  # type: ignore[arg-type]
    print(f"{'engine':>10}{'hit rate':>10}{'warm ms':>9}{'median':>8}{'warm/cold':>11}{'stored':>8}{'evicted':>9}"
          f"{'skip pool':>10}{'skip value':>11}{'KV evicted':>11}")  # fmt: skip
    summary: dict[str, object] = {}
    for p, core in warm.items():
        hit = sum(int(r[f"{p}.cached"]) for r in warm_rows)  # type: ignore[arg-type]
        times = [1000 * float(r[f"{p}.ttft_s"]) for r in warm_rows]  # type: ignore[arg-type]
        s, mean, ms = core.stats(), statistics.mean(times), spread(times)
        summary[p] = {"hit_rate": hit / q, "warm_ttft_ms_mean": mean, "warm_ttft_ms_median": ms["median"],
                      "warm_ttft_ms": ms, "cold_ttft_ms_mean": cold_ms, "stats": s}  # fmt: skip
        print(
            f"{p:>10}{100 * hit / q:>9.1f}%{mean:>9.1f}{ms['median']:>8.1f}"
            f"{mean / cold_ms:>11.3f}{s['checkpoints.stored']:>8}{s['checkpoints.evicted']:>9}"
            f"{s['checkpoints.skipped_pool']:>10}{s['checkpoints.skipped_value']:>11}{s['kv.evicted_blocks']:>11}"
        )
    return summary


def _print_host(summary: dict[str, object], host_core: EngineCore) -> None:
    host, ideal = summary["host"], summary["all-device"]
    s = host_core.stats()
    print(
        f"host tier: warm TTFT {host['warm_ttft_ms_mean']:.1f} ms vs all-device {ideal['warm_ttft_ms_mean']:.1f} ms "  # type: ignore[index]
        f"= {host['warm_ttft_ms_mean'] / ideal['warm_ttft_ms_mean']:.3f}x; hit tokens from host "  # type: ignore[index]
        f"{s['prefix_cache.hit_tokens_host']} of {s['prefix_cache.hit_tokens']}; promoted KV blocks "
        f"{s['host.kv_promoted_blocks']}, restores from host {s['host.checkpoints_restored']}, "
        f"moved {(s['host.bytes_loaded'] + s['host.bytes_saved']) / 2**20:.1f} MiB, load wait "
        f"{s['host.load_wait_ms']} ms over {s['host.loads_completed']} requests"
    )


def pressure(args: argparse.Namespace) -> dict[str, object]:
    """More conversations than the pools hold, the same prompts through every policy."""
    base = {"scheduler.max_num_batched_tokens": 8192, "cache.checkpoint_interval": 0}
    probe = EngineCore(config_from_args(args, base))
    state_bytes = probe.cache.config.checkpoint_bytes
    tok = probe.tokenizer
    rng = random.Random(args.seed)
    system = "You are a helpful assistant for cache experiments. " + " ".join(
        rng.choice(WORDS) for _ in range(60)
    )
    final_len = len(tok.encode(system)) + args.turns * 2 * (args.user_tokens + args.reply_tokens)
    kv_blocks = args.kv_blocks or max(args.kv_conversations * final_len // 16, 64)
    variants = _pressure_variants(args, probe, final_len, kv_blocks)
    warm = {name: EngineCore(config_from_args(args, {**base, **over}), loaded=probe.loaded)
            for name, over in variants.items()}  # fmt: skip
    cold = EngineCore(
        config_from_args(args, {**base, "cache.enable_prefix_caching": False}), loaded=probe.loaded
    )
    for core in (*warm.values(), cold):
        ttft(core, tok.encode("warm up", add_special_tokens=False), 2)
    rows = _pressure_rows(args, warm, cold, system, rng)
    warm_rows = [r for r in rows if r["turn"]]
    cold_ms = 1000 * statistics.mean(float(r["ttft_cold_s"]) for r in warm_rows)  # type: ignore[arg-type]
    print(
        f"\n{args.conversations} conversations x {args.turns} turns round-robin; {args.checkpoint_slots} checkpoint "
        f"slots ({state_bytes / 2**20:.2f} MiB each), {kv_blocks} KV blocks (~{args.kv_conversations} conversations); "
        f"warm turns: {len(warm_rows)}, cold TTFT mean {cold_ms:.1f} ms"
    )
    summary = _pressure_summary(rows, warm, cold_ms)
    if args.host:
        _print_host(summary, warm["host"])
    return {"rows": rows, "summary": summary}


def build_parser() -> argparse.ArgumentParser:
    ap = bench_parser(__doc__)
    add_config_args(ap)
    p = ap.add_argument_group("memory pressure (see above)")
    p.add_argument("--pressure", action="store_true", help="more conversations than the pools hold")
    p.add_argument("--conversations", type=int, default=8, help="conversations taking turns")
    p.add_argument("--checkpoint-slots", type=int, default=3, help="checkpoint pool, in checkpoints")
    p.add_argument("--kv-conversations", type=int, default=4, help="KV for about this many conversations")
    p.add_argument("--kv-blocks", type=int, help="KV blocks (overrides --kv-conversations)")
    p.add_argument("--policies", default="default,v1", help="cache.checkpoint_policy values to compare")
    p.add_argument("--host", action="store_true", help="also the host tier and the all-device ideal")
    p.add_argument("--one-budget", action="store_true", help="also the first policy, its bytes as one budget")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--user-tokens", type=int, default=220, help="approximate words per user message")
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument(
        "--repeat", type=int, default=3, help="interleaved warm and cold timings per turn (medians kept)"
    )
    ap.add_argument("--seed", type=int, default=0)
    return ap


def _conversation_rows(
    args: argparse.Namespace, warms: list[EngineCore], cold: EngineCore
) -> list[dict[str, Any]]:
    """Each turn timed on every warm replica and as often cold; the medians, and the ideal."""
    tok = cold.tokenizer
    rng = random.Random(args.seed)
    messages = [{"role": "system", "content": "You are a helpful assistant for cache experiments."}]
    rows: list[dict[str, Any]] = []
    for turn in range(args.turns):
        messages.append(
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(args.user_tokens))}
        )
        prompt = tok.encode(
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        replies: list[list[int]] = []
        cold_replies: list[list[int]] = []
        cached_seen: set[int] = set()
        replicas = iter(warms)

        def warm() -> float:
            t, reply, cached = ttft(next(replicas), prompt, args.reply_tokens)  # noqa: B023 (called at once)
            replies.append(reply)  # noqa: B023
            cached_seen.add(cached)  # noqa: B023
            return t

        def cold_run() -> float:
            t, reply, _ = ttft(cold, prompt, args.reply_tokens)  # noqa: B023 (called at once)
            cold_replies.append(reply)  # noqa: B023
            return t

        times = interleaved({"warm": warm, "cold": cold_run}, args.repeat)
        assert all(r == replies[0] for r in cold_replies), f"turn {turn}: cache hit changed the output"
        assert len(cached_seen) == 1 and all(r == replies[0] for r in replies), "warm replicas diverged"
        reply, cached = replies[0], cached_seen.pop()
        t_warm, t_cold = spread(times["warm"]), spread(times["cold"])
        ideal = (len(prompt) - cached) / len(prompt)
        rows.append(
            {
                "turn": turn,
                "prompt_tokens": len(prompt),
                "cached_tokens": cached,
                "ttft_warm_s": t_warm["median"],
                "ttft_cold_s": t_cold["median"],
                "ratio": t_warm["median"] / t_cold["median"],
                "ideal": ideal,
                "ttft_warm_spread_s": t_warm,
                "ttft_cold_spread_s": t_cold,
            }
        )
        messages.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)})
    return rows


def _print_conversation(rows: list[dict[str, Any]], warm: EngineCore) -> dict[str, object]:
    """The per-turn table and the totals; the warm engine's stats."""
    print(
        f"\n{'turn':>4}{'prompt':>8}{'cached':>8}{'hit%':>7}{'warm ms':>9}{'cold ms':>9}{'ratio':>8}{'ideal':>8}{'ratio/ideal':>12}"
    )
    for r in rows:
        print(
            f"{r['turn']:>4}{r['prompt_tokens']:>8}{r['cached_tokens']:>8}{100 * r['cached_tokens'] / r['prompt_tokens']:>6.1f}%"
            f"{1000 * r['ttft_warm_s']:>9.1f}{1000 * r['ttft_cold_s']:>9.1f}{r['ratio']:>8.3f}{r['ideal']:>8.3f}"
            f"{r['ratio'] / r['ideal']:>11.2f}x"
        )
    warm_rows = rows[1:]
    q = sum(r["prompt_tokens"] for r in rows)
    h = sum(r["cached_tokens"] for r in rows)
    mean_ratio = sum(r["ratio"] for r in warm_rows) / len(warm_rows)
    mean_ideal = sum(r["ideal"] for r in warm_rows) / len(warm_rows)
    s = warm.stats()
    print(
        f"\ntoken hit rate {h / q:.3f} (warm turns {sum(r['cached_tokens'] for r in warm_rows) / sum(r['prompt_tokens'] for r in warm_rows):.3f}); "
        f"warm/cold TTFT {mean_ratio:.3f} vs ideal {mean_ideal:.3f} -> {mean_ratio / mean_ideal:.2f}x of ideal"
    )
    print(
        f"checkpoints: stored {s['checkpoints.stored']}, attached {s['checkpoints.attached']}, "
        f"memory {s['checkpoints.bytes_used'] / 2**20:.1f} MiB of {s['checkpoints.slots'] * warm.cache.config.checkpoint_bytes / 2**20:.1f} MiB, "
        f"skipped budget {s['checkpoints.skipped_budget']}, skipped pool {s['checkpoints.skipped_pool']}, "
        f"evicted {s['checkpoints.evicted']}; KV evicted blocks {s['kv.evicted_blocks']}"
    )
    return s


def main() -> None:
    args = build_parser().parse_args()
    configure_logging("warning")
    bench = Bench("bench_prefix_cache", args)
    if args.pressure:
        results = pressure(args)
        print(describe_box(bench.before))
        bench.write(args.json, results)
        return
    base = {"scheduler.max_num_batched_tokens": 8192, "cache.num_kv_blocks": 4096}
    warm_cfg = config_from_args(args, base)
    cold_cfg = warm_cfg.replace(**{"cache.enable_prefix_caching": False})
    base_core = EngineCore(warm_cfg)
    cold = EngineCore(cold_cfg, loaded=base_core.loaded)
    # The warm side can be timed only once per cache state, so the whole conversation is
    # replayed on ``--repeat`` fresh warm engines (greedy: identical prompts and cache
    # states), interleaved with as many cold timings, and the per-turn medians are kept.
    warms = [base_core] + [EngineCore(warm_cfg, loaded=base_core.loaded) for _ in range(args.repeat - 1)]
    tok = base_core.tokenizer
    for core in (*warms, cold):
        ttft(core, tok.encode("warm up", add_special_tokens=False), 2)
    rows = _conversation_rows(args, warms, cold)
    s = _print_conversation(rows, base_core)
    print(describe_box(bench.before))
    bench.write(args.json, {"turns": rows, "stats": s})


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "bench_prefix_cache")
