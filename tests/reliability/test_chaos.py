"""Seeded chaos: random prompts sharing prefixes, multi-turn reuse of outputs, random
aborts (``abort()``, ``break``, task cancel), tight KV, 1-2 checkpoint slots, a tiny staging
budget, for each scheduling policy and both placements of the core (``in_process``:
``AsyncEngine`` over a core on its thread; ``separate``: over a core process). Checked:

* every request ends with a reason: finished + aborted == submitted, none failed;
* integrity holds throughout (``await engine.check_integrity()`` from a concurrent task; in a
  separate core it runs there, between steps) and after the run every pool is fully free
  (the core's stats);
* greedy outputs equal a cache-off, unconstrained engine's, token for token.

The default suite runs one seed per policy (seconds); ``-m slow`` runs the soak.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from deltaserve.engine import EngineCore, RequestOutput
from deltaserve.models import LoadedModel
from tests.engine.conftest import greedy, make_config, run_to_completion
from tests.reliability.conftest import (
    PLACEMENTS,
    Engine,
    assert_idle_pools,
    current_stats,
    open_engine,
    tokens,
)

POLICIES = ["fcfs", "priority", "lpm", "sjf"]
TIMEOUT = 120.0


@dataclass
class Tally:
    submitted: int = 0
    finished: list[tuple[list[int], int, list[int]]] = field(default_factory=list)  # prompt, n, tokens
    aborted_by: dict[str, int] = field(default_factory=lambda: {"abort": 0, "break": 0, "cancel": 0})


def tight_config(policy: str, state_bytes: int, slots: int) -> dict[str, Any]:
    return {
        "scheduler.policy": policy,
        "scheduler.max_num_seqs": 4,
        "scheduler.max_num_batched_tokens": 128,
        "cache.num_kv_blocks": 26,  # 416 tokens for 4 requests of up to 400: preemptions
        "cache.checkpoint_pool_bytes": slots * state_bytes,
        "cache.checkpoint_staging_bytes": state_bytes,  # one capture per step
        "cache.checkpoint_interval": 64,
        "model.max_model_len": 416,
    }


async def session(engine: Engine, rng: random.Random, prefixes: list[list[int]], tally: Tally) -> None:
    prompt = rng.choice(prefixes) + tokens(rng.randint(1, 60), rng.randrange(10**6))
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(1, 32)
        action = rng.choices(["finish", "abort", "break", "cancel"], weights=[6, 1, 1, 1])[0]
        stream = engine.generate(prompt, greedy(n), priority=rng.randint(-3, 3))
        tally.submitted += 1
        if action == "finish":
            outs: list[RequestOutput] = []
            async for out in stream:
                outs.append(out)
            assert outs[-1].finished and outs[-1].finish_reason == "length", outs[-1]
            got = [t for o in outs for t in o.token_ids]
            tally.finished.append((prompt, n, got))
            # the next turn re-sends this turn's output, then a new user message
            prompt = prompt + got + tokens(rng.randint(1, 30), rng.randrange(10**6))
            if len(prompt) + 32 >= 400:
                return
            continue
        k = rng.randint(0, n)
        if action == "abort":
            got_final = None
            for _ in range(k):
                out = await stream.__anext__()
                if out.finished:
                    got_final = out
                    break
            if got_final is None:
                engine.abort(stream.request_id)
                while not (out := await stream.__anext__()).finished:
                    pass
                got_final = out
            assert got_final.finish_reason in ("abort", "length")
        elif action == "break":
            i = 0
            async for _ in stream:
                i += 1
                if i > k:
                    break
        else:

            async def consume(s: Any = stream) -> None:
                async for _ in s:
                    await asyncio.sleep(0)

            task = asyncio.create_task(consume())
            await asyncio.sleep(rng.random() * 0.02)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        tally.aborted_by[action] += 1
        return  # an abandoned conversation ends


async def integrity_watch(engine: Engine, stop: asyncio.Event) -> int:
    checks = 0
    while not stop.is_set():
        await engine.check_integrity()
        checks += 1
        await asyncio.sleep(0.002)
    return checks


def reference_outputs(
    loaded: LoadedModel, finished: list[tuple[list[int], int, list[int]]]
) -> list[list[int]]:
    """The same prompts on a cache-off engine with roomy pools."""
    core = EngineCore(
        make_config(
            **{
                "cache.enable_prefix_caching": False,
                "cache.num_kv_blocks": 2048,
                "scheduler.max_num_seqs": 32,
            }
        ),
        loaded=loaded,
    )
    ids = []
    for prompt, n, _ in finished:
        req = core.make_request(prompt, greedy(n))
        core.add_request(req)
        ids.append(req.request_id)
    outs = run_to_completion(core)
    return [[t for o in outs[rid] for t in o.token_ids] for rid in ids]


async def run_chaos(
    loaded: LoadedModel, policy: str, seed: int, sessions: int, slots: int, placement: str = "in_process"
) -> dict[str, Any]:
    rng = random.Random(seed)
    state_bytes = loaded.model.cache_spec().state_slot_bytes()
    engine = open_engine(placement, loaded, **tight_config(policy, state_bytes, slots))
    prefixes = [tokens(rng.choice([64, 100, 150]), 1000 + i) for i in range(3)]
    tally = Tally()
    async with engine:
        stop = asyncio.Event()
        watcher = asyncio.create_task(integrity_watch(engine, stop))
        await asyncio.wait_for(
            asyncio.gather(
                *(session(engine, random.Random(rng.random()), prefixes, tally) for _ in range(sessions))
            ),
            TIMEOUT,
        )
        for _ in range(1000):  # abandoned streams are aborted between steps
            stats = await current_stats(engine)
            if not stats["scheduler.running"] and not stats["scheduler.waiting"]:
                break
            await asyncio.sleep(0.01)
        stop.set()
        checks = await watcher
        await engine.check_integrity()
        stats = await current_stats(engine)
    assert stats["requests.failed"] == 0
    assert stats["requests.finished"] + stats["requests.aborted"] == tally.submitted, (stats, tally)
    # every pool fully free after the run (cached blocks and checkpoints stay, unpinned)
    assert_idle_pools(stats)
    if engine.core is not None:  # the core runs in this process
        assert engine.core is not None
        engine.core.check_integrity()
        assert not engine.core.states, "engine-side request state leaked"
    expected = reference_outputs(loaded, tally.finished)
    for (prompt, _n, got), want in zip(tally.finished, expected, strict=True):
        assert got == want, f"policy {policy} seed {seed}: output changed for a {len(prompt)}-token prompt"
    return {
        "requests": tally.submitted,
        "finished": len(tally.finished),
        "aborts": dict(tally.aborted_by),
        "preemptions": stats["scheduler.preemptions"],
        "hit_tokens": stats["prefix_cache.hit_tokens"],
        "checkpoints_skipped": stats["checkpoints.skipped_budget"] + stats["checkpoints.skipped_pool"],
        "integrity_checks": checks,
    }


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("policy", POLICIES)
async def test_chaos(tiny_loaded: LoadedModel, policy: str, placement: str) -> None:
    summary = await run_chaos(
        tiny_loaded, policy, seed=POLICIES.index(policy), sessions=6, slots=1, placement=placement
    )
    assert summary["finished"] > 0 and summary["integrity_checks"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("policy", POLICIES)
async def test_chaos_soak(tiny_loaded: LoadedModel, policy: str, placement: str) -> None:
    totals: dict[str, Any] = {}
    for seed in range(6):
        summary = await run_chaos(
            tiny_loaded, policy, seed=100 + seed, sessions=24, slots=1 + seed % 2, placement=placement
        )
        for key, value in summary.items():
            if isinstance(value, dict):
                for k, v in value.items():
                    totals.setdefault(key, {}).setdefault(k, 0)
                    totals[key][k] += v
            else:
                totals[key] = totals.get(key, 0) + value
    print(f"\nchaos soak [{policy}, {placement}]: {totals}")
