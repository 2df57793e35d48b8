"""The step-time model and the prefill budget of steps with decodes (torch-free).

Step times here come from a synthetic machine, ``a + b·prefill (+ c·decodes)`` seconds, so every
expected budget is computed by hand from its coefficients.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from deltaserve.cache import CacheManager, CacheManagerConfig
from deltaserve.scheduler import Request, Scheduler, make_policy
from deltaserve.scheduler.step_budget import StepBudget, StepTimeModel

A, B = 0.100, 0.001  # 100 ms a step, 1 ms a prefill token


def machine(prefill: int, decodes: int, a: float = A, b: float = B, c: float = 0.0) -> float:
    """Seconds of a step; ``c`` per decode (the model folds the decodes of the moment into a)."""
    return a + b * prefill + c * decodes


def fitted(n: int = 60, seed: int = 0, **coef: float) -> StepTimeModel:
    """A model fed ``n`` steps of random mixes (prefill-only, decode-only, mixed) of 4 decodes."""
    rng = random.Random(seed)
    m = StepTimeModel()
    for _ in range(n):
        p = rng.choice([0, 0, 64, 128, 512, 2048])
        d = rng.choice([0, 4]) if p else 4
        m.observe(p, d, machine(p, d, **coef))
    return m


# ---------------------------------------------------------------------- the model
def test_fit_recovers_the_coefficients() -> None:
    a, b = fitted().coefficients
    assert a == pytest.approx(A, rel=1e-4)  # (exact data: only the prior's pull is left)
    assert b == pytest.approx(B, rel=1e-4)
    assert fitted().predict(300) == pytest.approx(machine(300, 0), rel=1e-4)


def test_the_decodes_of_the_moment_are_in_the_base_time() -> None:
    m = StepTimeModel()
    for _ in range(60):  # 8 decodes at 5 ms each: a step's fixed work is 140 ms now
        for p in (0, 256):
            m.observe(p, 8, machine(p, 8, c=0.005))
    assert m.coefficients == pytest.approx((0.140, B), rel=1e-3)
    for _ in range(200):  # the batch shrinks to 2 decodes: the base follows
        for p in (0, 256):
            m.observe(p, 2, machine(p, 2, c=0.005))
    assert m.coefficients == pytest.approx((0.110, B), rel=1e-3)


def test_ready_needs_a_step_with_prefill_and_one_without() -> None:
    m = StepTimeModel()
    for _ in range(10):
        m.observe(0, 4, machine(0, 4))
    assert not m.ready and m.steps == 10 and m.prefill_steps == 0
    m.observe(256, 0, machine(256, 0))
    assert m.ready and m.coefficients == pytest.approx((A, B), rel=1e-2)
    only_prefill = StepTimeModel()
    for p in (128, 512, 64):
        only_prefill.observe(p, 0, machine(p, 0))
    assert not only_prefill.ready
    m.observe(0, 0, 5.0)  # a step that computed nothing tells nothing
    assert m.steps == 11 and m.coefficients == pytest.approx((A, B), rel=1e-2)


def test_one_outlier_is_damped() -> None:
    m = fitted()
    before = m.predict(0)
    m.observe(0, 4, 100 * machine(0, 4))  # a stray 10 s step (a pause)
    # clipped to 4x the prediction, then weighed as one step of the last ~50
    assert before < m.predict(0) < 1.15 * before
    for _ in range(150):
        m.observe(0, 4, machine(0, 4))
    assert m.predict(0) == pytest.approx(before, rel=0.01)


def test_follows_a_change_of_speed() -> None:
    m = fitted()
    rng = random.Random(1)
    for _ in range(300):  # the machine halves its prefill speed
        p = rng.choice([0, 128, 512])
        m.observe(p, 4, machine(p, 4, b=2 * B))
    assert m.coefficients[1] == pytest.approx(2 * B, rel=0.02)


def test_long_decode_only_runs_keep_the_fit_finite() -> None:
    m = fitted()
    for _ in range(5000):  # no prefill for a long time: its variance is capped, not unbounded
        m.observe(0, 4, machine(0, 4))
    assert m.cov[0][0] + m.cov[1][1] <= 1e6 * (1 + 1e-9)
    m.observe(512, 4, machine(512, 4))
    assert m.coefficients == pytest.approx((A, B), rel=1e-3)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StepTimeModel(forgetting=0.0), r"forgetting = 0.0: must be in \(0, 1\]"),
        (lambda: StepTimeModel().observe(64, 1, float("nan")), "step time nan: must be a finite"),
        (lambda: StepTimeModel().observe(64, 1, -1.0), "step time -1.0: must be a finite"),
        (lambda: StepBudget(min_tokens=0), "min_tokens = 0: must be >= 1"),
        (lambda: StepBudget(min_tokens=64, factor=1.0), r"factor = 1.0: must be > 1"),
        (lambda: StepBudget(min_tokens=64, factor=0.0), "target_ms = 0.0: must be > 0 when factor is 0"),
    ],
)
def test_bad_arguments(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


# ---------------------------------------------------------------------- the budget
def test_budget_is_what_fits_in_the_target() -> None:
    sb = StepBudget(min_tokens=64, factor=3.0, model=fitted())
    # decodes take 100 ms alone, target 300 ms: 200 ms of prefill at 1 ms a token
    assert sb.prefill_budget(8, 2048) in (199, 200)
    assert sb.last_budget in (199, 200)
    assert sb.prefill_budget(8, 150) == 150  # never more than the step's own budget
    assert sb.prefill_budget(0, 2048) == 2048  # no decodes: the full budget (TTFT)
    fixed = StepBudget(min_tokens=64, factor=3.0, target_ms=600.0, model=fitted())
    assert fixed.prefill_budget(8, 2048) in (499, 500)  # (600 - 100) ms of prefill
    stats = fixed.stats()
    assert stats["scheduler.step_model.prefill_us_per_token"] == pytest.approx(1000.0, rel=1e-3)
    assert stats["scheduler.step_model.base_ms"] == pytest.approx(100.0, rel=1e-3)
    assert stats["scheduler.decode_step_prefill_budget"] in (499.0, 500.0)


def test_budget_shrinks_on_a_slow_machine_but_never_below_the_minimum() -> None:
    fast = StepBudget(min_tokens=64, model=fitted(b=B / 10))  # prefill is cheap: a lot fits
    slow = StepBudget(min_tokens=64, model=fitted())
    assert fast.factor == 3.0  # (the default)
    assert fast.prefill_budget(4, 4096) in (1999, 2000)  # (300 - 100 ms) / 0.1 ms
    assert slow.prefill_budget(4, 4096) in (199, 200)
    tight = StepBudget(min_tokens=64, factor=0.0, target_ms=50.0, model=fitted())  # < one decode step
    assert tight.prefill_budget(4, 2048) == 64
    odd = StepTimeModel(theta=[-0.05, B * 1024], steps=5, prefill_steps=2)  # no decode time left
    broken = StepBudget(min_tokens=64, model=odd)
    assert broken.prefill_budget(4, 2048) == 64  # is not trusted with more


def test_untrained_or_degenerate_model_leaves_the_budget_full() -> None:
    assert StepBudget(min_tokens=64).prefill_budget(4, 2048) == 2048
    free = StepTimeModel()  # prefill costs nothing measurable
    for i in range(20):
        free.observe(64 * (i % 3), 4, machine(0, 4))
    assert free.ready and abs(free.coefficients[1]) < 1e-3 * B
    assert StepBudget(min_tokens=64, model=free).prefill_budget(4, 2048) == 2048


# ---------------------------------------------------------------------- in the scheduler
class Params:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens


def make_scheduler(policy: str, step_budget: StepBudget | None) -> Scheduler:
    cm = CacheManager(
        CacheManagerConfig(
            block_size=16, num_kv_blocks=2000, num_live_slots=16, num_checkpoint_slots=8, checkpoint_bytes=1
        )
    )
    return Scheduler(
        cm, make_policy(policy), max_num_seqs=16, max_num_batched_tokens=2048, step_budget=step_budget
    )


def request(rid: str, n: int, max_tokens: int, t: float) -> Request:
    base = 100_000 * (1 + sum(map(ord, rid)))
    r = Request(rid, list(range(base, base + n)), Params(max_tokens))
    r.arrival_time = t
    return r


def run(s: Scheduler, steps: int) -> list[tuple[int, int]]:
    """Simulated steps (the synthetic machine's time reported); (decodes, prefill tokens) of each."""
    shape: list[tuple[int, int]] = []
    for _ in range(steps):
        out = s.schedule()
        if out is None:
            break
        prefill = out.num_tokens - out.num_decodes
        s.observe_step(out, machine(prefill, out.num_decodes))
        s.update(out, [7 if x.samples else None for x in out.seqs])
        for x in out.seqs:
            if x.samples and x.request.num_output_tokens >= x.request.sampling_params.max_tokens:
                s.finish(x.request, "length")
        s.check_integrity()
        shape.append((out.num_decodes, prefill))
    return shape


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "priority", "sjf"])
def test_steps_with_decodes_take_a_bounded_prefill(policy: str) -> None:
    s = make_scheduler(policy, StepBudget(min_tokens=64, factor=2.0, model=fitted()))
    for i in range(4):
        s.add(request(f"d{i}", 100, 400, t=i))
    assert run(s, 3) == [(0, 400), (4, 0), (4, 0)]
    s.add(request("long", 6000, 1, t=9))
    s.add(request("short", 50, 1, t=10))
    # decodes take 100 ms alone, target 200 ms: 100 prefill tokens a step: the long prompt's
    # chunks end on block boundaries (96), the short prompt (50) fits whole but not beside a
    # chunk of 96; which comes first is the policy's (sjf: the short one, with 48 of the long)
    shape = run(s, 6)
    first = (4, 98) if policy == "sjf" else (4, 96)
    assert shape == [first] + [(4, 96)] * 5
    assert s.step_budget is not None and s.step_budget.last_budget in (99, 100)
    assert s.stats()["scheduler.decode_step_prefill_budget"] in (99.0, 100.0)


def test_without_decodes_or_bound_the_step_takes_the_full_budget() -> None:
    bounded = make_scheduler("fcfs", StepBudget(min_tokens=64, factor=2.0, model=fitted()))
    bounded.add(request("p", 5000, 1, t=0))
    assert run(bounded, 2) == [(0, 2048), (0, 2048)]
    off = make_scheduler("fcfs", None)
    for i in range(4):
        off.add(request(f"d{i}", 100, 400, t=i))
    run(off, 3)
    off.add(request("long", 6000, 1, t=9))
    # decodes + the rest of the token budget (2044), floored to the unit (a block)
    assert run(off, 2) == [(4, 2032), (4, 2032)]
    assert "scheduler.decode_step_prefill_budget" not in off.stats()


def test_the_trim_holds_bounded_steps_to_the_target_when_short_chunks_cost_more() -> None:
    """Prefill-only steps of 512 tokens teach the model ~1.16 ms a token; a chunk also costs
    80 ms of per-segment work the linear fit spreads over 512 tokens. Bounded steps (4
    decodes, target 3 x 100 ms) run 18 % over at first and 8 % over in the steady mix without
    the trim; with it they end within 3 % of the target, and once the per-chunk cost goes away
    the trim grows back toward 1."""

    def step(prefill: int, extra: float = 0.08) -> float:
        return machine(prefill, 4) + (extra if prefill else 0.0)

    sb = StepBudget(min_tokens=16, factor=3.0)
    for _ in range(30):  # the engine's mix: whole prompts alone, decodes alone
        sb.observe(512, 0, machine(512, 0) + 0.08)
        sb.observe(0, 4, machine(0, 4))
    assert step(sb.prefill_budget(4, 2048)) > 1.15 * sb.target_s()  # untrimmed: over

    def mix(extra: float) -> float:
        """Whole prompts alone and decodes alone go on beside the bounded steps (they keep
        the fit where it was); the last bounded step's time over the target."""
        for _ in range(40):
            sb.observe(512, 0, machine(512, 0) + extra)
            sb.observe(0, 4, machine(0, 4))
            budget = sb.prefill_budget(4, 2048)
            seconds = step(budget, extra)
            sb.observe(budget, 4, seconds)
        return seconds / sb.target_s()

    assert 0.95 <= mix(0.08) <= 1.03
    assert 0.25 <= sb.trim < 0.95
    assert sb.stats()["scheduler.decode_step_trim"] == sb.trim
    trimmed = sb.trim
    assert 0.95 <= mix(0.0) <= 1.03  # the per-chunk cost goes away: the trim grows back
    assert sb.trim > trimmed
    # a budget that the step's own token budget cut, not the target, teaches the trim nothing
    before = sb.trim
    assert sb.prefill_budget(4, 8) == 8 and not sb.last_cut
    sb.observe(8, 4, 10.0)
    assert sb.trim == before
