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


async def test_the_last_output_carries_the_requests_draft_counts(core_factory: Any) -> None:
    """A request's last output has its own drafted and accepted tokens (every other output
    none), whether the core ended it or the front end did (a stop string)."""
    p = prompt(60, 2)
    core = core_factory(**{"speculative.method": "replay", "speculative.replay_corrupt_every": 2})
    async with AsyncEngine(core=core) as engine:
        first = await collect(engine, p, greedy(24))  # nothing recorded yet: no drafts
        text = "".join(o.text for o in first)
        before = core.stats()
        second = await collect(engine, p, greedy(24))
        mid = core.stats()
        stop = text[12:15]
        third = await collect(engine, p, greedy(24, stop=[stop]))
        after = core.stats()
    assert (first[-1].num_draft_tokens, first[-1].num_accepted_tokens) == (0, 0)
    for outs, (a, b) in ((second, (before, mid)), (third, (mid, after))):
        assert all((o.num_draft_tokens, o.num_accepted_tokens) == (0, 0) for o in outs[:-1])
        drafted = b["spec_decode.num_draft_tokens"] - a["spec_decode.num_draft_tokens"]
        accepted = b["spec_decode.num_accepted_tokens"] - a["spec_decode.num_accepted_tokens"]
        assert drafted > accepted > 0  # every other draft wrong
        if outs is second:
            assert (outs[-1].num_draft_tokens, outs[-1].num_accepted_tokens) == (drafted, accepted)
        else:  # the stop string ended it in the front end: the counts of the deltas it saw
            assert third[-1].finish_reason == "stop"
            assert 0 < outs[-1].num_draft_tokens <= drafted and outs[-1].num_accepted_tokens <= accepted
