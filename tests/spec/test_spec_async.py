"""Speculative decoding with ``engine.async_scheduling``: greedy outputs identical to speculation
off and to the plain (synchronous) loop, for every drafter, under preemption, with aborts
around verifies, through a separate core process; the pools whole after every step
(``run_to_completion``); a step that verifies never overlaps another, and steps without
drafts (prefill chunks) still do."""

from __future__ import annotations

from typing import Any

import pytest

from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.models import LoadedModel
from tests.engine.conftest import greedy, make_config
from tests.spec.test_spec_greedy import MAX_TOKENS, _prompts, _replay, _serve, _spec, serve_two_turns
from tests.spec.test_spec_mtp import MTP, _assert_consistent, mtp_loaded  # noqa: F401

ASYNC = {"engine.async_scheduling": True}


class StepWatch:
    """Wraps ``core``'s scheduler and forward worker: counts the verify steps scheduled while a
    step was in flight (must stay 0), the verify steps, and the steps handed to the worker."""

    def __init__(self, core: EngineCore) -> None:
        overlap = core.overlap
        assert overlap is not None
        self.verifies = self.overlapped_verifies = self.submitted = 0
        schedule, submit = core.scheduler.schedule, overlap._submit

        def watched_schedule() -> Any:
            out = schedule()
            if out is not None and out.num_verify:
                self.verifies += 1
                # a draft follows a real token: nothing in flight, no placeholder anywhere
                if overlap.flight is not None:
                    self.overlapped_verifies += 1
                assert all(t >= 0 for r in core.scheduler.running for t in r.token_ids)
            return out

        def watched_submit(out: Any, prev: Any, outputs: Any) -> Any:
            assert not out.num_verify  # a verify step is never handed to the worker
            self.submitted += 1
            return submit(out, prev, outputs)

        core.scheduler.schedule = watched_schedule  # type: ignore[method-assign]
        overlap._submit = watched_submit  # type: ignore[method-assign]


@pytest.mark.parametrize(("method", "corrupt"), [("replay", 0), ("replay", 2), ("ngram", 0)])
def test_async_outputs_equal_speculation_off_and_the_plain_loop(
    core_factory: Any, method: str, corrupt: int
) -> None:
    prompts = _prompts(20, repeat=method == "ngram")
    # a small token budget: the prompts take several prefill chunks, which still overlap
    small = {"scheduler.max_num_batched_tokens": 64}
    off = _serve(core_factory(**small), prompts, greedy(MAX_TOKENS))
    spec = {
        "speculative.method": method,
        "speculative.replay_corrupt_every": corrupt,
        "speculative.prompt_lookup_min": 1,
    }
    runs = []
    for overlap in (False, True):
        core = core_factory(**small, **spec, **({**ASYNC} if overlap else {}))
        if method == "replay":
            _replay(core, prompts, off)
        watch = StepWatch(core) if overlap else None
        assert _serve(core, prompts, greedy(MAX_TOKENS)) == off
        s = _spec(core)
        assert s["spec_decode.num_draft_tokens"] > 0
        runs.append(s)
        if watch is not None:
            assert watch.verifies > 0 and watch.overlapped_verifies == 0
            assert watch.submitted > 0  # the steps without drafts overlapped
            core.close()
    # the same verifies, drafts and acceptances as the plain loop
    assert runs[0] == runs[1]


def test_async_mtp_outputs_equal_speculation_off(mtp_loaded: LoadedModel) -> None:  # noqa: F811
    from tests.spec.test_spec_mtp import _prompts as mtp_prompts

    prompts = mtp_prompts(0)
    small = {"scheduler.max_num_batched_tokens": 64}
    off = _serve(EngineCore(make_config(**small), loaded=mtp_loaded), prompts, greedy(MAX_TOKENS))
    core = EngineCore(make_config(**small, **MTP, **ASYNC), loaded=mtp_loaded)
    watch = StepWatch(core)
    assert _serve(core, prompts, greedy(MAX_TOKENS)) == off
    _assert_consistent(_spec(core))
    assert watch.verifies > 0 and watch.overlapped_verifies == 0 and watch.submitted > 0
    core.close()
    assert core.speculation.drafter.proposals == {}  # type: ignore[union-attr]


def test_async_preemption_with_a_small_pool(core_factory: Any) -> None:
    prompts = _prompts(22, n=6)
    small = {"cache.num_kv_blocks": 14, "cache.enable_prefix_caching": True}
    off = _serve(core_factory(**small), prompts, greedy(MAX_TOKENS))
    core = core_factory(
        **small, **ASYNC, **{"speculative.method": "replay", "speculative.replay_corrupt_every": 3}
    )
    _replay(core, prompts, off)
    assert _serve(core, prompts, greedy(MAX_TOKENS)) == off
    assert core.stats()["scheduler.preemptions"] > 0
    assert _spec(core)["spec_decode.num_accepted_tokens"] > 0
    core.close()


def test_async_abort_after_a_verify_and_while_in_flight(core_factory: Any) -> None:
    """One request aborted right after a step that verified its drafts, another while the step
    in flight holds it (its end waits for that step's commit): the others stay identical, the
    aborted ones got a prefix of their output, and the pools end whole."""
    prompts = _prompts(23, n=5)
    off = _serve(core_factory(), prompts, greedy(MAX_TOKENS))
    core = core_factory(**ASYNC, **{"speculative.method": "replay", "speculative.replay_corrupt_every": 2})
    drafter = core.speculation.drafter  # type: ignore[union-attr]
    for i in (0, 1, 2, 4):  # r3 never drafts: once alone, its steps overlap
        drafter.record(prompts[i], off[f"r{i}"])  # type: ignore[union-attr]
    for i, p in enumerate(prompts[:4]):
        core.add_request(core.make_request(p, greedy(MAX_TOKENS), request_id=f"r{i}"))
    overlap = core.overlap
    assert overlap is not None
    got: dict[str, list[int]] = {}
    after_verify = in_flight = added = False
    while core.has_work():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
        core.check_integrity()
        drafts = _spec(core)["spec_decode.num_drafts"]
        if not after_verify and drafts >= 3:
            assert overlap.flight is None  # a verify step is processed before step() returns
            final = core.abort_request("r1")
            assert final is not None and final.finish_reason == "abort"
            after_verify = True
            core.check_integrity()
            core.add_request(core.make_request(prompts[4], greedy(MAX_TOKENS), request_id="r4"))
            added = True
        elif added and not in_flight and overlap.flight is not None:
            r3 = core.scheduler.requests.get("r3")
            if r3 is not None and r3 in overlap.flight.requests:
                final = core.abort_request("r3")
                assert final is not None and final.finish_reason == "abort"
                assert core.abort_request("r3") is None  # ending: not aborted twice
                in_flight = True
    assert after_verify and in_flight
    core.close()
    assert core.cache.slots.num_free_live == core.cache.slots.num_live
    for rid in ("r0", "r2", "r4"):
        assert got[rid] == off[rid]
    for rid in ("r1", "r3"):
        assert got.get(rid, []) == off[rid][: len(got.get(rid, []))]


def test_async_multi_turn_prefix_hits_unchanged(core_factory: Any) -> None:
    prompts = _prompts(24, n=3)
    follow = [[5 + 7 * i + j for j in range(9)] for i in range(len(prompts))]

    def two_turns(core: EngineCore, replay: dict[str, list[int]] | None) -> tuple[dict[str, list[int]], int]:
        both, _, hits = serve_two_turns(core, prompts, follow, replay)
        return both, hits

    off, off_hits = two_turns(core_factory(), None)
    core = core_factory(**ASYNC, **{"speculative.method": "replay"})
    on, on_hits = two_turns(core, off)
    assert on == off
    assert off_hits > sum(len(p) for p in prompts)  # turn 2 hit into turn 1's output
    assert on_hits >= 0.99 * off_hits
    assert _spec(core)["spec_decode.acceptance_rate"] == 1.0
    core.close()


async def test_a_separate_core_process_with_async_scheduling_speculates(core_factory: Any) -> None:
    from tests.engine.conftest import separate
    from tests.engine.test_api import collect, prompt

    p = prompt(60, 2)
    async with AsyncEngine(core=core_factory()) as engine:
        want = [t for o in await collect(engine, p, greedy(24)) for t in o.token_ids]
    config = separate(make_config(**ASYNC, **{"speculative.method": "replay"}))
    async with AsyncEngine(config) as engine:
        for _ in range(2):  # the first run teaches the drafter, the second replays it
            outs = await collect(engine, p, greedy(24))
            assert [t for o in outs for t in o.token_ids] == want
        await engine.check_integrity()
        stats = await engine.fetch_stats()
    assert stats["spec_decode.acceptance_rate"] == 1.0 and stats["spec_decode.num_accepted_tokens"] > 0
    # the request's own counts crossed the process boundary on its last output
    assert outs[-1].num_draft_tokens == outs[-1].num_accepted_tokens == stats["spec_decode.num_draft_tokens"]
