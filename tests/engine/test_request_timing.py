"""Each request's first output carries its queue and prefill times (``RequestOutput.queue_time_s``
/ ``prefill_time_s``); no other output does. A request that waits behind a full batch shows it."""

from __future__ import annotations

import asyncio

import pytest

from deltaserve.engine import AsyncEngine, EngineCore, SamplingParams
from deltaserve.models import LoadedModel

from .conftest import make_config


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_first_output_carries_queue_and_prefill_time(
    tiny_loaded: LoadedModel, async_scheduling: bool
) -> None:
    config = make_config(**{"scheduler.max_num_seqs": 1, "engine.async_scheduling": async_scheduling})
    async with AsyncEngine(core=EngineCore(config, loaded=tiny_loaded)) as engine:

        async def run(prompt: str) -> list:
            params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
            return [out async for out in engine.generate(prompt, params)]

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first, second = await asyncio.gather(run("Once upon a time"), run("The quick brown fox"))
        elapsed = loop.time() - t0
    for outs in (first, second):
        assert [o.queue_time_s is not None for o in outs] == [True] + [False] * (len(outs) - 1)
        assert [o.prefill_time_s is not None for o in outs] == [True] + [False] * (len(outs) - 1)
        assert 0 <= outs[0].queue_time_s + outs[0].prefill_time_s <= elapsed
    # one running slot: one waited while the other ran its prefill and all of its decodes
    runner, waiter = sorted((first[0], second[0]), key=lambda o: o.queue_time_s)
    assert waiter.queue_time_s > runner.prefill_time_s
