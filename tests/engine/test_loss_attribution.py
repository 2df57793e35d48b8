"""A live engine (built-in tiny model, ``AsyncEngine``) counts every missed prompt token under
one cause (``cache/loss.py``): its stats sum to the misses and match what a few multi-turn
requests and a prompt-logprobs request must produce."""

from __future__ import annotations

import random
from typing import Any

from deltaserve.cache.loss import MISS_CAUSES, MISS_PREFIX, QUERY_CAUSES
from deltaserve.engine import AsyncEngine
from tests.engine.conftest import greedy


async def test_multi_turn_misses_sum_to_their_causes(core_factory: Any) -> None:
    core = core_factory()
    bs = core.cache.block_size
    rng = random.Random(5)
    first = [rng.randrange(3, 1000) for _ in range(70)]
    async with AsyncEngine(core=core) as engine:
        convo, lengths = list(first), []
        for _ in range(3):  # one conversation, one turn after another
            lengths.append(len(convo))
            outs = [o async for o in engine.generate(convo, greedy(5))]
            convo += [t for o in outs for t in o.token_ids] + [rng.randrange(3, 1000) for _ in range(20)]
        # the first turn again, asking for its prompt's log-probabilities: its hit is given up
        outs = [o async for o in engine.generate(first, greedy(2, prompt_logprobs=1))]
        assert outs[-1].finish_reason == "length"
        s = engine.stats()
    causes = {c: s[MISS_PREFIX + c] for c in MISS_CAUSES if s[MISS_PREFIX + c]}
    misses = s["prefix_cache.query_tokens"] - s["prefix_cache.hit_tokens"]
    assert sum(s[MISS_PREFIX + c] for c in QUERY_CAUSES) == misses
    assert s["prefix_cache.queries"] == 4
    # ample memory, one request at a time: only new tokens, the tail and the logprobs request miss
    top = [(n - 1) // bs * bs for n in lengths]  # the deepest boundary each turn may hit
    # each later turn hits the previous one's output checkpoint: its prompt and 4 computed outputs
    hits = [0] + [(n + 4) // bs * bs for n in lengths[:-1]]
    assert s["prefix_cache.hit_tokens"] == sum(hits)
    assert causes == {
        "cold": sum(t - h for t, h in zip(top, hits, strict=True)),
        "granularity": sum(n - t for n, t in zip(lengths, top, strict=True)) + len(first) - top[0],
        "prompt_logprobs": top[0],  # the first turn's tail checkpoint, given up
    }
