"""The bound on a decode step's prefill, end to end: the engine reports its step times, the
bound shrinks the prefill of steps with decodes, and greedy outputs stay those of no bound."""

from __future__ import annotations

import random
from typing import Any

import pytest

from deltaserve.engine import ConfigError, EngineConfig
from tests.engine.conftest import greedy, run_to_completion


def shapes(core: Any) -> list[tuple[int, int]]:
    """(decodes, prefill tokens) of every step the scheduler emits from now on."""
    seen: list[tuple[int, int]] = []
    schedule = core.scheduler.schedule

    def recording() -> Any:
        out = schedule()
        if out is not None and out.seqs:
            seen.append((out.num_decodes, out.num_tokens - out.num_decodes))
        return out

    core.scheduler.schedule = recording
    return seen


def workload(core: Any) -> dict[str, list[int]]:
    """Four streams decode while two long prompts arrive; the greedy tokens of each request."""
    rng = random.Random(7)
    streams = [core.make_request([rng.randrange(3, 1000) for _ in range(40)], greedy(30)) for _ in range(4)]
    for r in streams:
        core.add_request(r)
    outs: dict[str, list[int]] = {}
    for _ in range(4):  # the streams' prompts, then some decode-only steps
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    for n in (700, 500):
        core.add_request(core.make_request([rng.randrange(3, 1000) for _ in range(n)], greedy(4)))
    for rid, seq in run_to_completion(core).items():
        for o in seq:
            outs.setdefault(rid, []).extend(o.token_ids)
    return {rid[-8:]: toks for rid, toks in sorted(outs.items())}  # (ids differ per engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bound_shrinks_decode_steps_and_keeps_outputs(core_factory: Any, async_scheduling: bool) -> None:
    common = {"scheduler.max_num_batched_tokens": 512, "engine.async_scheduling": async_scheduling}
    off = core_factory(**common, **{"scheduler.decode_step_factor": 0.0})
    # a target below any decode step: every step with decodes gets the minimum, one unit
    tight = core_factory(**common, **{"scheduler.max_decode_step_ms": 0.001})
    assert off.scheduler.step_budget is None
    off_shapes, tight_shapes = shapes(off), shapes(tight)
    off_out, tight_out = workload(off), workload(tight)
    assert list(tight_out.values()) == list(off_out.values())
    unit = tight.cache.unit
    assert max(p for d, p in off_shapes if d) > unit  # without the bound decodes share big chunks
    model = tight.scheduler.step_budget.model
    assert model.ready and model.steps >= len(tight_shapes) - 2  # every step was reported
    assert model.coefficients[1] > 0  # prefill costs time
    # the model is ready after its second step with prefill (the first chunk of the long
    # prompts, at the full budget); from then on one unit a step with decodes (with async
    # scheduling a step's time is reported after the next step was scheduled: one step later)
    first = [i for i, (d, p) in enumerate(tight_shapes) if p][1] + 1 + int(async_scheduling)
    late = [p for d, p in tight_shapes[first:] if d]
    assert late and max(late) <= unit
    assert sum(1 for d, p in tight_shapes if d and p) > sum(1 for d, p in off_shapes if d and p)
    tight.close()
    off.close()


def test_default_is_on_and_config_is_checked() -> None:
    sc = EngineConfig().scheduler
    assert sc.decode_step_factor == 3.0 and sc.max_decode_step_ms == 0.0  # on by default
    with pytest.raises(ConfigError, match=r"scheduler.decode_step_factor = 1.0: must be > 1"):
        EngineConfig.load(None, {"scheduler.decode_step_factor": 1.0})
    with pytest.raises(ConfigError, match="max_decode_step_ms"):
        EngineConfig.load(None, {"scheduler.max_decode_step_ms": -5.0})
