"""Speculative decoding through the front end: a verify's several tokens arrive as one delta,
and a stop string inside them cuts the text exactly where speculation off cuts it."""

from __future__ import annotations

from typing import Any

from deltaserve.engine import AsyncEngine
from tests.engine.conftest import greedy
from tests.engine.test_api import collect, prompt


async def test_stop_string_inside_an_accepted_run(core_factory: Any) -> None:
    p = prompt(60, 2)
    async with AsyncEngine(core=core_factory()) as engine:
        text = "".join(o.text for o in await collect(engine, p, greedy(24)))
        stop = text[7:10]
        want = await collect(engine, p, greedy(24, stop=[stop]))
    assert want[-1].finish_reason == "stop" and "".join(o.text for o in want) == text[: text.index(stop)]
    core = core_factory(**{"speculative.method": "replay"})
    async with AsyncEngine(core=core) as engine:
        first = await collect(engine, p, greedy(24))  # the replay drafter learns this output
        assert "".join(o.text for o in first) == text
        got = await collect(engine, p, greedy(24, stop=[stop]))
        await engine.check_integrity()
    assert got[-1].finish_reason == "stop"
    assert any(len(o.token_ids) > 1 for o in got)  # a verify's tokens came as one delta
    assert "".join(o.text for o in got) == text[: text.index(stop)]
    s = core.stats()
    assert s["spec_decode.num_accepted_tokens"] > 0 and s["spec_decode.acceptance_rate"] == 1.0
    assert not core.has_work()


async def test_a_separate_core_process_speculates_and_reports_it(core_factory: Any) -> None:
    from tests.engine.conftest import make_config, separate

    p = prompt(60, 2)
    async with AsyncEngine(core=core_factory()) as engine:
        want = [t for o in await collect(engine, p, greedy(24)) for t in o.token_ids]
    config = separate(make_config(**{"speculative.method": "replay"}))
    async with AsyncEngine(config) as engine:
        for _ in range(2):  # the first run teaches the drafter, the second replays it
            got = [t for o in await collect(engine, p, greedy(24)) for t in o.token_ids]
            assert got == want
        await engine.check_integrity()
        stats = await engine.fetch_stats()
    assert stats["spec_decode.acceptance_rate"] == 1.0
