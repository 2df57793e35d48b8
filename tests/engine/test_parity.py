"""Engine outputs equal transformers `generate`, token for token (greedy, fp32)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from deltaserve.engine import AsyncEngine, RequestOutput
from tests.engine.conftest import greedy, hf_greedy, make_config

LENGTHS = [1, 2, 5, 17, 63, 64, 65, 100, 128, 129, 200, 255, 300, 450, 601, 700]


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


async def test_concurrent_staggered_requests_match_transformers(tiny_loaded: Any, hf_tiny: Any) -> None:
    from deltaserve.engine import EngineCore

    prompts = make_prompts(int(tiny_loaded.hf_config.vocab_size))
    max_new = [4 + (i * 5) % 9 for i in range(len(prompts))]
    expected = [hf_greedy(hf_tiny, p, n) for p, n in zip(prompts, max_new, strict=True)]

    core = EngineCore(make_config(), loaded=tiny_loaded)

    async def one(i: int, engine: AsyncEngine) -> list[RequestOutput]:
        await asyncio.sleep(0.02 * (i % 5))  # staggered arrivals join a running batch
        return [o async for o in engine.generate(prompts[i], greedy(max_new[i]))]

    async with AsyncEngine(core=core) as engine:
        results = await asyncio.gather(*(one(i, engine) for i in range(len(prompts))))
    for i, outs in enumerate(results):
        tokens = [t for o in outs for t in o.token_ids]
        assert tokens == expected[i], f"prompt {i} (len {LENGTHS[i]}) diverged"
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert all(not o.finished for o in outs[:-1])
        assert outs[-1].num_prompt_tokens == LENGTHS[i]
    core.check_integrity()
    assert core.cache.slots.num_free_live == core.cache.slots.num_live
