"""Fault injection: a fault, a bad value or a stale handle stays with its own
request, and the engine never dies silently.

Each reported reproduction is a test here. EngineCore-level tests check integrity after
every step (``run_to_completion``); engine-level tests bound every wait with a timeout so a
regression shows as a failure, not a hang. The engine-level fault tests run over both
placements of the core (``in_process``: ``AsyncEngine``; ``separate``: ``AsyncEngine`` over ``ProcCoreClient`` and
a core process, its faults injected through the core hook, tests/reliability/core_hooks.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from deltaserve.engine import (
    AsyncEngine,
    EngineCore,
    EngineDeadError,
    InvalidRequestError,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
)
from deltaserve.models import LoadedModel
from deltaserve.scheduler import FCFSPolicy, PolicyContext, Request
from tests.engine.conftest import greedy, run_to_completion
from tests.reliability.conftest import PLACEMENTS, assert_idle_pools, current_stats, open_engine, tokens
from tests.reliability.core_hooks import ERRORS, inject_commit_fault, inject_step_fault, use_hook

TIMEOUT = 60.0


async def drain(stream: Any) -> list[RequestOutput]:
    """Read a stream to its final output (bounded)."""

    async def read() -> list[RequestOutput]:
        outs = []
        while True:
            out = await stream.__anext__()
            outs.append(out)
            if out.finished:
                return outs

    return await asyncio.wait_for(read(), TIMEOUT)


def text_tokens(outs: Sequence[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def solo_greedy(core_factory: Callable[..., EngineCore], prompt: list[int], n: int) -> list[int]:
    core = core_factory(**{"cache.enable_prefix_caching": False})
    req = core.make_request(prompt, greedy(n))
    core.add_request(req)
    return text_tokens(run_to_completion(core)[req.request_id])


def assert_pools_free(core: EngineCore) -> None:
    core.check_integrity()
    assert not core.has_work()
    assert core.cache.blocks.num_free + core.cache.tree.num_nodes == core.cache.blocks.num_blocks
    assert core.cache.slots.num_free_live == core.cache.slots.num_live
    assert core.cache.tree.num_pinned == 0
    assert not core.states, "engine-side request state leaked"


# ---------------------------------------------------------------------- 1, 2: values
async def test_huge_priority_is_refused_and_the_priority_policy_serves_on(engine_factory: Any) -> None:
    async with engine_factory(**{"scheduler.policy": "priority"}) as engine:
        for p in (10**400, -(10**400), 2**31, -(2**31) - 1):
            with pytest.raises(
                InvalidRequestError, match=r"priority must be an int in \[-2\*\*31, 2\*\*31\)"
            ):
                engine.generate("Hi", greedy(2), priority=p)
        outs = await asyncio.gather(
            *(
                drain(engine.generate(tokens(20, i), greedy(3), priority=p))
                for i, p in enumerate((2**31 - 1, -(2**31), 0))
            )
        )
        assert [o[-1].finish_reason for o in outs] == ["length"] * 3
        assert engine.is_healthy()
        await engine.check_integrity()


async def test_extreme_but_valid_sampling_values_never_fail_a_step(
    engine_factory: Any, core_factory: Any
) -> None:
    innocent = tokens(30, 7)
    expected = solo_greedy(core_factory, innocent, 6)
    extreme = [
        SamplingParams(max_tokens=4, top_k=2**31 - 1),
        SamplingParams(max_tokens=4, temperature=1e-38, ignore_eos=True),
        SamplingParams(max_tokens=4, seed=2**64 - 1, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=1e6, top_p=1e-9, ignore_eos=True),
    ]
    async with engine_factory() as engine:
        streams = [engine.generate(tokens(25, 100 + i), p) for i, p in enumerate(extreme)]
        mine = engine.generate(innocent, greedy(6))
        results = await asyncio.gather(*(drain(s) for s in [*streams, mine]))
    assert all(r[-1].finish_reason in ("length", "stop") for r in results), [r[-1] for r in results]
    assert text_tokens(results[-1]) == expected
    # temperature 1e-38 decodes greedily
    assert text_tokens(results[1]) == solo_greedy(core_factory, tokens(25, 101), 4)


# ---------------------------------------------------------------------- 3: the loop dies
async def wait_unhealthy(engine: Any) -> None:
    """A separate core's front end sees the process exit within its watch interval."""
    for _ in range(int(TIMEOUT / 0.02)):
        if not engine.is_healthy():
            return
        await asyncio.sleep(0.02)
    pytest.fail("the engine still reports healthy after its loop died")


@pytest.mark.parametrize(
    ("placement", "kind"),
    [
        *(("in_process", kind) for kind in ERRORS),
        ("separate", "keyerror"),
        # the core loop catches every BaseException alike: the other kinds only cost a core start
        *(pytest.param("separate", kind, marks=pytest.mark.slow) for kind in ("cancelled", "doom")),
    ],
)
async def test_a_step_raising_anything_marks_the_engine_dead(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, placement: str, kind: str
) -> None:
    # (an ordinary exception escaping the step machinery itself is not one request's fault:
    # it stops the loop too, under the same contract)
    if placement == "separate":
        use_hook(monkeypatch, "step_fault", at=3, kind=kind)
    engine = open_engine(placement, tiny_loaded)
    await engine.start()
    if engine.core is not None:  # the core runs in this process
        assert engine.core is not None
        inject_step_fault(engine.core, 3, ERRORS[kind])
    streams = [engine.generate(tokens(40, i), greedy(30)) for i in range(3)]
    results = await asyncio.gather(*(drain(s) for s in streams))
    for outs in results:
        assert outs[-1].finished and outs[-1].finish_reason == "error"
        assert outs[-1].error is not None and "engine loop died" in outs[-1].error
        assert repr(ERRORS[kind]) in outs[-1].error
    await wait_unhealthy(engine)
    dead = "engine loop died" if placement == "in_process" else r"the engine core process \(pid \d+\) died"
    with pytest.raises(EngineDeadError, match=dead):
        engine.generate("Hi", greedy(2))
    with pytest.raises(EngineDeadError):
        await engine.check_integrity()
    await asyncio.wait_for(engine.shutdown(), TIMEOUT)  # never raises for a dead loop
    if engine.core is None:
        assert engine.client.handle is not None and engine.client.handle.exitcode == 1  # type: ignore[attr-defined]
    else:
        assert engine.core is not None
        assert_pools_free(engine.core)


async def test_a_cancelled_loop_task_marks_the_engine_dead(engine_factory: Any) -> None:
    engine: AsyncEngine = engine_factory()
    await engine.start()
    stream = engine.generate(tokens(40, 1), greedy(200))
    first = await asyncio.wait_for(stream.__anext__(), TIMEOUT)
    assert not first.finished
    (loop_task,) = [t for t in asyncio.all_tasks() if t.get_name() == "deltaserve-engine-loop"]
    loop_task.cancel()  # e.g. an application cancelling every task at exit
    outs = await drain(stream)
    assert outs[-1].finish_reason == "error" and "engine loop died" in (outs[-1].error or "")
    with pytest.raises(EngineDeadError):
        engine.generate("Hi", greedy(2))
    await asyncio.wait_for(engine.shutdown(), TIMEOUT)
    assert engine.core is not None
    assert_pools_free(engine.core)


# ---------------------------------------------------------------------- 4: per-request faults
class _ExplodingStopIds(frozenset[int]):
    def __contains__(self, token: object) -> bool:
        raise RuntimeError("injected stop check fault")


def test_a_raising_stop_check_ends_only_its_request(core_factory: Any) -> None:
    core: EngineCore = core_factory()
    bad = core.make_request(tokens(30, 1), greedy(8))
    good_prompt = tokens(30, 2)
    good = core.make_request(good_prompt, greedy(8))
    core.add_request(bad)
    core.add_request(good)
    core.states[bad.request_id].stop_ids = _ExplodingStopIds()
    outs = run_to_completion(core)
    assert outs[bad.request_id][-1].finish_reason == "error"
    assert "output processing failed: RuntimeError: injected stop check fault" in (
        outs[bad.request_id][-1].error or ""
    )
    assert outs[good.request_id][-1].finish_reason == "length"
    assert text_tokens(outs[good.request_id]) == solo_greedy(core_factory, good_prompt, 8)
    assert core.stats()["requests.failed"] == 1
    assert_pools_free(core)


def test_a_commit_that_raises_ends_only_that_steps_requests(core_factory: Any) -> None:
    core: EngineCore = core_factory(**{"cache.checkpoint_interval": 64})
    first = core.make_request(tokens(100, 1), greedy(5))
    core.add_request(first)
    real = core.cache.commit_step
    calls = {"n": 0}

    def commit(plan: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected commit fault")
        real(plan)

    core.cache.commit_step = commit  # type: ignore[method-assign]
    outs = run_to_completion(core)
    assert outs[first.request_id][-1].finish_reason == "error"
    assert "cache commit failed: RuntimeError: injected commit fault" in (
        outs[first.request_id][-1].error or ""
    )
    assert core.stats()["steps.failed"] == 1
    assert_pools_free(core)
    # the engine serves on, with outputs unchanged
    later_prompt = tokens(100, 1)
    later = core.make_request(later_prompt, greedy(5))
    core.add_request(later)
    outs = run_to_completion(core)
    assert outs[later.request_id][-1].finish_reason == "length"
    assert text_tokens(outs[later.request_id]) == solo_greedy(core_factory, later_prompt, 5)
    assert_pools_free(core)


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_a_commit_that_raises_ends_only_its_request_and_the_engine_serves_on(
    tiny_loaded: LoadedModel, core_factory: Any, monkeypatch: pytest.MonkeyPatch, placement: str
) -> None:
    """The engine-level twin of the test above, in the core's own process too."""
    if placement == "separate":
        use_hook(monkeypatch, "commit_fault", at=2)
    prompt = tokens(100, 1)
    async with open_engine(placement, tiny_loaded, **{"cache.checkpoint_interval": 64}) as engine:
        if engine.core is not None:  # the core runs in this process
            assert engine.core is not None
            inject_commit_fault(engine.core, 2)
        first = await drain(engine.generate(prompt, greedy(5)))
        assert first[-1].finish_reason == "error"
        assert "cache commit failed: RuntimeError: injected commit fault" in (first[-1].error or "")
        later = await drain(engine.generate(prompt, greedy(5)))
        assert later[-1].finish_reason == "length"
        assert text_tokens(later) == solo_greedy(core_factory, prompt, 5)
        assert engine.is_healthy()
        await engine.check_integrity()
        stats = await current_stats(engine)
    assert stats["steps.failed"] == 1
    assert (stats["requests.failed"], stats["requests.finished"]) == (1, 1)
    assert_idle_pools(stats)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_commit_that_raises_half_way_leaves_the_cache_whole(
    core_factory: Any, async_scheduling: bool
) -> None:
    """The commit has published the step's blocks when attaching its checkpoint raises: the
    cache stays whole (integrity after every step), the step's request ends with an error,
    and the request waiting behind it serves exactly its fault-free tokens."""
    core: EngineCore = core_factory(
        **{
            "cache.checkpoint_interval": 64,
            "scheduler.max_num_seqs": 1,
            "engine.async_scheduling": async_scheduling,
        }
    )
    first = core.make_request(tokens(100, 1), greedy(5))
    later_prompt = tokens(100, 1) + tokens(40, 3)  # shares what the failed commit published
    later = core.make_request(later_prompt, greedy(5))
    core.add_request(first)
    core.add_request(later)
    real = core.cache.ckpts.attach
    calls = {"n": 0}

    def attach(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            assert core.cache.tree.num_nodes > 0, "the fault is meant to come after publishing"
            raise RuntimeError("injected attach fault")
        real(*args, **kwargs)

    core.cache.ckpts.attach = attach  # type: ignore[method-assign]
    outs = run_to_completion(core)  # (integrity checked after every step)
    assert calls["n"] >= 1
    assert outs[first.request_id][-1].finish_reason == "error"
    assert "cache commit failed: RuntimeError: injected attach fault" in (
        outs[first.request_id][-1].error or ""
    )
    assert core.stats()["steps.failed"] == 1
    assert outs[later.request_id][-1].finish_reason == "length"
    assert text_tokens(outs[later.request_id]) == solo_greedy(core_factory, later_prompt, 5)
    assert_pools_free(core)


class ExplodingPolicy(FCFSPolicy):
    """A user's policy that raises in both of its calls."""

    name = "exploding"

    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        raise ZeroDivisionError("policy bug")

    def preemption_victim(self, candidates: Sequence[Request], ctx: PolicyContext) -> Request:
        raise ZeroDivisionError("policy bug")


class EmptyPolicy(FCFSPolicy):
    """Orders nothing, forever."""

    name = "empty"

    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        return []


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("policy", ["ExplodingPolicy", "EmptyPolicy"])
async def test_a_broken_policy_never_stops_the_engine(
    tiny_loaded: LoadedModel, policy: str, placement: str
) -> None:
    # (a separate core imports the policy by this name in its own process)
    dotted = {"scheduler.policy": f"tests.reliability.test_engine_faults:{policy}", "cache.num_kv_blocks": 24}
    async with open_engine(placement, tiny_loaded, **dotted) as engine:
        results = await asyncio.gather(*(drain(engine.generate(tokens(90, i), greedy(12))) for i in range(6)))
        assert [r[-1].finish_reason for r in results] == ["length"] * 6
        assert engine.is_healthy()
        await engine.check_integrity()
        stats = await current_stats(engine)
    assert (stats["requests.finished"], stats["requests.failed"]) == (6, 0)
    assert_idle_pools(stats)
    if policy == "ExplodingPolicy":
        assert stats["scheduler.policy_errors"] > 0


@pytest.mark.parametrize("placement", ["in_process", "separate"])
async def test_a_raising_detokenizer_in_the_front_end_ends_only_its_request(
    tiny_loaded: LoadedModel, core_factory: Any, placement: str
) -> None:
    """The front end detokenizes in every placement: a fault there ends its request with an
    error, the core aborts it, and the other request is untouched."""
    good_prompt = tokens(30, 2)
    async with open_engine(placement, tiny_loaded) as engine:
        assert (engine.core is None) == (placement == "separate")
        bad = engine.generate(tokens(30, 1), greedy(8))
        good = engine.generate(good_prompt, greedy(8))

        def explode(ids: list[int]) -> str:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

        bad.completions[0].detokenizer.add = explode  # type: ignore[method-assign]
        bad_outs, good_outs = await asyncio.gather(drain(bad), drain(good))
        assert bad_outs[-1].finish_reason == "error"
        assert "output processing failed: UnicodeDecodeError" in (bad_outs[-1].error or "")
        assert good_outs[-1].finish_reason == "length"
        assert text_tokens(good_outs) == solo_greedy(core_factory, good_prompt, 8)
        await engine.check_integrity()
        for _ in range(int(TIMEOUT / 0.02)):  # the abort reaches the core after the error
            stats = await current_stats(engine)
            if stats["requests.aborted"] + stats["requests.finished"] == 2:
                break
            await asyncio.sleep(0.02)
    assert (stats["requests.aborted"], stats["requests.finished"], stats["requests.failed"]) == (1, 1, 0)
    assert_idle_pools(stats)


# ---------------------------------------------------------------------- 5: ids belong to their stream
async def test_a_stale_stream_never_aborts_a_newer_request_reusing_its_id(engine_factory: Any) -> None:
    async with engine_factory() as engine:
        it1 = engine.generate("Hello", greedy(5), request_id="X")
        done = await drain(it1)
        assert done[-1].finish_reason == "length"
        it2 = engine.generate("Other", greedy(60), request_id="X")
        await asyncio.wait_for(it2.__anext__(), TIMEOUT)
        await it1.aclose()  # a stale handle: X is now it2's
        outs = await drain(it2)
        assert outs[-1].finish_reason == "length"

        # the same when the first stream was abandoned by `break`: once X is free again, a
        # new X is not touched by the old handle
        it3 = engine.generate("Hello", greedy(200), request_id="Y")
        async for _ in it3:
            break
        for _ in range(500):  # the abort is applied between steps
            try:
                it4 = engine.generate("Other", greedy(20), request_id="Y")
                break
            except InvalidRequestError:
                await asyncio.sleep(0.01)
        else:
            pytest.fail("request id Y never became free after its stream was abandoned")
        await it3.aclose()
        assert (await drain(it4))[-1].finish_reason == "length"


# ---------------------------------------------------------------------- 8: leaving a stream
async def test_break_while_holding_the_stream_aborts(engine_factory: Any) -> None:
    async with engine_factory() as engine:
        stream = engine.generate(tokens(30, 3), greedy(300))
        async for _ in stream:
            break
        outs = await drain(stream)  # the stream is still held: it ends with the abort
        assert outs[-1].finish_reason == "abort"
        assert len(text_tokens(outs)) < 299
        await engine.check_integrity()
        assert engine.stats()["requests.aborted"] == 1


async def test_abort_acts_without_await(engine_factory: Any) -> None:
    async with engine_factory() as engine:
        stream = engine.generate(tokens(30, 4), greedy(300))
        await asyncio.wait_for(stream.__anext__(), TIMEOUT)
        engine.abort(stream.request_id)  # not awaited
        outs = await drain(stream)
        assert outs[-1].finish_reason == "abort"
        assert await engine.abort(stream.request_id) is False  # already gone


async def test_cancelling_the_consumer_aborts(engine_factory: Any) -> None:
    async with engine_factory() as engine:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(tokens(30, 5), greedy(300)):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), TIMEOUT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):
            if engine.stats()["requests.aborted"] == 1:
                break
            await asyncio.sleep(0.01)
        assert engine.stats()["requests.aborted"] == 1
        await engine.check_integrity()
        assert engine.stats()["live_slots.used"] == 0


async def test_an_oversized_prompt_is_refused_before_tokenizing(
    engine_factory: Any, monkeypatch: Any
) -> None:
    async with engine_factory() as engine:
        assert engine.core is not None
        calls = {"n": 0}
        real = engine.core.tokenizer.encode

        def encode(*a: Any, **k: Any) -> Any:
            calls["n"] += 1
            return real(*a, **k)

        monkeypatch.setattr(engine.core.tokenizer, "encode", encode)
        with pytest.raises(
            PromptTooLongError, match=r"prompt has 1000000 characters: more than max_model_len"
        ):
            engine.generate("x" * 1_000_000, greedy(2))
        with pytest.raises(PromptTooLongError, match=r"message 0 content has 1000000 characters"):
            engine.generate([{"role": "user", "content": "y" * 1_000_000}], greedy(2))
        assert calls["n"] == 0
