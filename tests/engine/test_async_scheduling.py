"""``engine.async_scheduling``: the overlapped loop gives exactly the outputs of the plain one.

Step N+1 is scheduled and launched before step N's tokens are known (placeholders resolved on
the device), step N's outputs are processed while N+1 runs, and a request found finished
after N+1 was scheduled has its extra token discarded. Every test compares the overlapped
engine with the plain one (or the reference) request by request, and checks the cache's
integrity after every step (``run_to_completion``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from deltaserve.engine import AsyncEngine, EngineCore, RequestOutput, SamplingParams
from deltaserve.scheduler.request import RequestStatus
from tests.engine.conftest import greedy, run_to_completion

ASYNC = {"engine.async_scheduling": True}

Result = tuple[list[int], str, str | None]


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def summary(outs: list[RequestOutput]) -> Result:
    """A request's whole reply: token ids, text (an ``AsyncEngine``'s; a core emits token ids
    only), finish reason (exactly one final output)."""
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    text = "".join(getattr(o, "text", "") for o in outs)
    return [t for o in outs for t in o.token_ids], text, outs[-1].finish_reason


def serve(
    core: EngineCore, waves: list[list[tuple[str, list[int], SamplingParams]]]
) -> dict[str, list[RequestOutput]]:
    """Run each wave to completion (integrity after every step); outputs by request id."""
    outs: dict[str, list[RequestOutput]] = {}
    for wave in waves:
        for rid, prompt, params in wave:
            core.add_request(core.make_request(prompt, params, request_id=rid))
        outs.update(run_to_completion(core))
    core.close()
    return outs


def both(
    core_factory: Callable[..., EngineCore],
    waves: list[list[tuple[str, list[int], SamplingParams]]],
    **config: Any,
) -> tuple[dict[str, list[RequestOutput]], dict[str, list[RequestOutput]], EngineCore]:
    """The same waves on the plain engine and the overlapped one; the overlapped core too."""
    plain = serve(core_factory(**config), waves)
    core = core_factory(**config, **ASYNC)
    assert core.async_scheduling
    overlapped = serve(core, waves)
    assert sorted(plain) == sorted(overlapped)
    return plain, overlapped, core


def test_greedy_outputs_equal_with_and_without_overlap(core_factory: Callable[..., EngineCore]) -> None:
    """Prompts of many lengths (chunked prefills, unit boundaries), max_tokens reached at
    different steps, then a second wave that hits the prefix cache."""
    first = prompts(0, (1, 2, 5, 17, 63, 64, 65, 129, 200, 300))
    wave1 = [(f"a{i}", p, greedy(1 + (i * 7) % 13)) for i, p in enumerate(first)]
    wave2 = [(f"b{i}", p + [7, 8, 9], greedy(4 + i % 5)) for i, p in enumerate(first)]
    plain, overlapped, core = both(core_factory, [wave1, wave2], **{"cache.checkpoint_interval": 64})
    for rid in plain:
        assert summary(overlapped[rid]) == summary(plain[rid]), rid
    hits = [overlapped[f"b{i}"][-1].num_cached_tokens for i in range(len(first))]
    assert sum(hits) > 0 and hits == [plain[f"b{i}"][-1].num_cached_tokens for i in range(len(first))]
    assert core.stats()["requests.finished"] == 2 * len(first)


def test_stop_tokens_and_stop_strings_end_at_the_same_token(core_factory: Callable[..., EngineCore]) -> None:
    """A stop token id / stop string found in step N ends the request although N+1 was
    already scheduled for it: the extra token is discarded, output and text are unchanged."""
    ps = prompts(1, (9, 40, 70, 33))
    ref = serve(core_factory(), [[(f"r{i}", p, greedy(24)) for i, p in enumerate(ps)]])
    wave = []
    for i, p in enumerate(ps):
        tokens, text, _ = summary(ref[f"r{i}"])
        stop_id = tokens[3 + i]  # a token the reply really produces, at a different step each
        wave.append((f"id{i}", p, greedy(24, stop_token_ids=[stop_id])))
        stop_text = text[len(text) // 2 : len(text) // 2 + 2]
        if stop_text:
            wave.append((f"str{i}", p, greedy(24, stop=[stop_text])))
        wave.append((f"min{i}", p, greedy(24, stop_token_ids=[stop_id], min_tokens=10)))
    plain, overlapped, _ = both(core_factory, [wave])
    for rid in plain:
        assert summary(overlapped[rid]) == summary(plain[rid]), rid
    assert {summary(plain[r])[2] for r in plain} == {"stop", "length"} or all(
        summary(plain[r])[2] == "stop" for r in plain
    )


def test_abort_in_the_middle_loses_nothing(core_factory: Callable[..., EngineCore]) -> None:
    """Aborting a request that is in the step in flight: one final ``abort`` output at once,
    no output for it afterwards, its blocks and slots back; the others are unchanged."""
    ps = prompts(2, (20, 50, 90, 130))
    ref = serve(core_factory(), [[(f"r{i}", p, greedy(12)) for i, p in enumerate(ps)]])
    for abort_at in (1, 3, 6):
        core = core_factory(**ASYNC)
        for i, p in enumerate(ps):
            core.add_request(core.make_request(p, greedy(12), request_id=f"r{i}"))
        outs: dict[str, list[RequestOutput]] = {}
        for step in range(200):
            if not core.has_work():
                break
            if step == abort_at:
                victim = core.scheduler.requests["r1"]
                final = core.abort_request("r1")
                assert final is not None and final.finish_reason == "abort"
                outs.setdefault("r1", []).append(final)
                assert core.abort_request("r1") is None  # already ended: no second output
                core.check_integrity()
            for o in core.step():
                outs.setdefault(o.request_id, []).append(o)
            core.check_integrity()
        assert not core.has_work()
        assert victim.status is RequestStatus.FINISHED
        assert outs["r1"][-1].finish_reason == "abort" and sum(o.finished for o in outs["r1"]) == 1
        got = [t for o in outs["r1"] for t in o.token_ids]
        assert got == summary(ref["r1"])[0][: len(got)]
        for rid in ("r0", "r2", "r3"):
            assert summary(outs[rid]) == summary(ref[rid]), (abort_at, rid)
        assert core.cache.slots.num_free_live == core.cache.slots.num_live
        core.close()


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_preemption_while_a_step_is_in_flight(core_factory: Callable[..., EngineCore], policy: str) -> None:
    """A KV pool too small for the batch: requests are preempted while their placeholder is
    pending (it is dropped, and the token appended when it arrives); outputs unchanged. (``lpm``
    matches waiting requests against the cache while ordering them: a placeholder must never
    be hashed.)"""
    ps = prompts(3, (40, 45, 50, 55, 60, 65))
    wave = [(f"p{i}", p, greedy(40)) for i, p in enumerate(ps)]
    config = {"cache.num_kv_blocks": 24, "scheduler.policy": policy}
    plain = serve(core_factory(**config), [wave])
    core = core_factory(**config, **ASYNC)
    real = core.scheduler._preempt
    pending: list[bool] = []

    def preempt(victim: Any) -> None:
        pending.append(victim.token_ids[-1] < 0)
        real(victim)
        assert all(t >= 0 for t in victim.token_ids)

    core.scheduler._preempt = preempt  # type: ignore[method-assign]
    overlapped = serve(core, [wave])
    assert any(pending)  # some victim had a token on its way
    for rid in plain:
        assert summary(overlapped[rid]) == summary(plain[rid]), rid


def test_penalties_logprobs_and_seeded_sampling_match(core_factory: Callable[..., EngineCore]) -> None:
    """Rows that are not plain greedy take the general sampler; their penalties count the
    previous step's token (a placeholder when the step was scheduled)."""
    ps = prompts(4, (12, 30, 70))
    wave = [
        ("rep", ps[0], greedy(16, repetition_penalty=1.5, frequency_penalty=0.5)),
        ("lp", ps[1], greedy(10, logprobs=3)),
        ("seed", ps[2], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)),
        ("plain", ps[1], greedy(8)),
    ]
    plain, overlapped, _ = both(core_factory, [wave])
    for rid in plain:
        assert summary(overlapped[rid]) == summary(plain[rid]), rid
    lp_plain = [lp for o in plain["lp"] for lp in o.logprobs or []]
    lp_over = [lp for o in overlapped["lp"] for lp in o.logprobs or []]
    # (a batch holds other requests at other steps, so the fp32 logits may differ in the last bits)
    assert len(lp_plain) == 10 and len(lp_over) == 10
    for a, b in zip(lp_over, lp_plain, strict=True):
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_failed_step_ends_its_requests_and_the_next_steps(
    core_factory: Callable[..., EngineCore], monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    """The forward of step N raises after N's plan was committed ahead: N's requests and those
    of N+1 (scheduled on N's results) end with ``error``, what N published is dropped, and the
    engine goes on serving with unchanged outputs. (Step 1 prefills both prompts and captures
    checkpoints: served from the cache afterwards, they would change the outputs.)"""
    ps = prompts(5, (70, 300))
    config = {"cache.checkpoint_interval": 64}
    core = core_factory(**ASYNC, **config)
    real = core.runner.launch
    calls = {"n": 0}

    def flaky(prep: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("injected fault")
        return real(prep)

    monkeypatch.setattr(core.runner, "launch", flaky)
    for i, p in enumerate(ps):
        core.add_request(core.make_request(p, greedy(6), request_id=f"f{i}"))
    outs = run_to_completion(core)
    for i in range(len(ps)):
        assert outs[f"f{i}"][-1].finish_reason == "error"
        assert "injected fault" in (outs[f"f{i}"][-1].error or "")
        assert sum(o.finished for o in outs[f"f{i}"]) == 1
    assert core.stats()["requests.failed"] == len(ps)
    if fail_at == 1:
        assert core.cache.tree.num_nodes == 0  # all step 1 published was never written
    # the same prompts again: served right, whatever the failed step had published
    wave = [(f"g{i}", p, greedy(6)) for i, p in enumerate(ps)]
    again = serve(core, [wave])
    ref = serve(core_factory(**config), [wave])
    for rid in ref:
        assert summary(again[rid]) == summary(ref[rid]), rid


def test_a_commit_that_raises_spares_a_request_already_ended(core_factory: Callable[..., EngineCore]) -> None:
    """Step 3's early commit raises while ``short`` (finished by step 2's token, in step 3
    already) waits to end: ``short`` keeps its one ``length`` output, ``long`` ends with
    ``error``, nothing leaks."""
    ps = prompts(7, (30, 40))
    core = core_factory(**ASYNC)
    real = core.cache.commit_step
    calls = {"n": 0}

    def commit(plan: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected commit fault")
        real(plan)

    core.cache.commit_step = commit  # type: ignore[method-assign]
    core.add_request(core.make_request(ps[0], greedy(2), request_id="short"))
    core.add_request(core.make_request(ps[1], greedy(8), request_id="long"))
    outs = run_to_completion(core)
    ref = serve(core_factory(), [[("short", ps[0], greedy(2))]])
    assert summary(outs["short"]) == summary(ref["short"])
    assert summary(outs["long"])[2] == "error"
    assert "cache commit failed" in (outs["long"][-1].error or "")
    assert not core.states and core.cache.tree.num_pinned == 0
    core.close()


async def test_async_engine_with_overlap_matches_plain(core_factory: Callable[..., EngineCore]) -> None:
    """Through ``AsyncEngine``: staggered arrivals, one consumer that leaves early (abort)."""
    ps = prompts(6, (3, 30, 64, 100, 150))

    async def run(core: EngineCore) -> dict[str, Result]:
        async def one(i: int, engine: AsyncEngine) -> tuple[str, Result]:
            await asyncio.sleep(0.01 * i)
            outs = [o async for o in engine.generate(ps[i], greedy(6 + i), request_id=f"q{i}")]
            return f"q{i}", summary(outs)

        async def leaver(engine: AsyncEngine) -> None:
            async for o in engine.generate(ps[2], greedy(50), request_id="leaver"):
                if len(o.token_ids) and o.text is not None:
                    break  # leaving the loop aborts the request

        async with AsyncEngine(core=core) as engine:
            results = await asyncio.gather(*(one(i, engine) for i in range(len(ps))), leaver(engine))
            await engine.check_integrity()
        assert core.cache.slots.num_free_live == core.cache.slots.num_live
        return dict(r for r in results if r is not None)

    plain = await run(core_factory())
    overlapped = await run(core_factory(**ASYNC))
    assert overlapped == plain


# ---------------------------------------------------------------------- with the host tier
# The host tier's engine tests (tests/engine/test_host_tier.py), on the overlapped loop: the
# step's copies run on the worker before its forward and land at the early commit.
def _async_factory(core_factory: Callable[..., EngineCore]) -> Callable[..., EngineCore]:
    return lambda **dotted: core_factory(**{**dotted, **ASYNC})


def test_host_tier_demotion_and_promotion_change_nothing(core_factory: Callable[..., EngineCore]) -> None:
    from tests.engine import test_host_tier

    test_host_tier.test_demoted_and_promoted_state_changes_nothing(_async_factory(core_factory), "default")


def test_host_tier_one_copy_per_step(core_factory: Callable[..., EngineCore]) -> None:
    from tests.engine import test_host_tier

    test_host_tier.test_one_copy_per_step_budget_changes_nothing(_async_factory(core_factory))


def test_host_tier_failed_load_and_save(
    core_factory: Callable[..., EngineCore], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.engine import test_host_tier

    test_host_tier.test_failed_load_ends_only_the_request_that_needed_it(
        _async_factory(core_factory), monkeypatch
    )
    monkeypatch.undo()
    test_host_tier.test_failed_save_drops_items_and_fails_no_request(
        _async_factory(core_factory), monkeypatch
    )
