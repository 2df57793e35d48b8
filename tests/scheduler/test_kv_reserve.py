"""Admission under KV pressure (``scheduler/kv_reserve.py``): long prompts arriving faster than
the device holds them wait for room instead of preempting each other half built. Torch-free."""

from __future__ import annotations

from deltaserve.cache import CacheManager, CacheManagerConfig
from deltaserve.scheduler import Request, Scheduler, make_policy
from deltaserve.scheduler.kv_reserve import (
    FITS,
    FLOOR_RESERVED,
    FLOOR_WAIT_STEPS,
    Shortfall,
    charge_floor,
    floor_reserved,
    kv_capacity,
    kv_headroom,
    kv_shortfall,
    tracking_held,
)
from deltaserve.scheduler.request import RequestStatus
from tests.scheduler.stepping import step


class Params:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens


def make(blocks: int, *, reserve: bool = True, budget: int = 128) -> Scheduler:
    cm = CacheManager(
        CacheManagerConfig(
            block_size=16, num_kv_blocks=blocks, num_live_slots=16, num_checkpoint_slots=8, checkpoint_bytes=1
        )
    )
    return Scheduler(
        cm, make_policy("fcfs"), max_num_seqs=16, max_num_batched_tokens=budget, reserve_prompts=reserve
    )


def prompt(i: int, n: int, max_tokens: int) -> Request:
    # distinct tokens per request: no prefix hits, so every computed token is the prompt's own
    return Request(f"r{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + n)), Params(max_tokens))


def drain(s: Scheduler, reqs: list[Request], max_steps: int = 20_000) -> int:
    """Run to completion; the tokens computed (prompt and output, recomputes included)."""
    for r in reqs:
        s.add(r)
    computed = 0
    for _ in range(max_steps):
        if not s.has_work():
            return computed
        computed += step(s).num_tokens
        s.check_integrity()
    raise AssertionError("did not finish")


def overload() -> list[Request]:
    # eight 400-token prompts (25 blocks each) at once into 64 blocks, each then decoding 16
    # tokens while the next prefill: two fit side by side
    return [prompt(i, 400, max_tokens=16) for i in range(8)]


def test_overload_admits_only_what_fits_and_preempts_nobody() -> None:
    s = make(64)
    reqs = overload()
    computed = drain(s, reqs)
    assert all(r.finish_reason == "length" and r.num_output_tokens == 16 for r in reqs)
    assert s.num_preemptions == 0
    assert all(r.num_preemptions == 0 for r in reqs)
    # each prompt computed once, plus its 15 decodes (the first token ends the prefill)
    assert computed == 8 * (400 + 15)
    assert s.cache.counters.get("prefix_cache.miss_tokens.preemption", 0) == 0


def test_without_the_reservation_the_same_arrivals_thrash() -> None:
    """The behaviour the reservation replaces: first chunks admitted side by side outgrow the
    pool and preempt each other, recomputing what they had built."""
    s = make(64, reserve=False)
    computed = drain(s, overload())
    assert s.num_preemptions > 8
    assert computed > 8 * (400 + 15) + 400


def test_a_prompt_larger_than_the_headroom_runs_alone_and_all_finish() -> None:
    s = make(64)
    big = prompt(0, 900, max_tokens=3)  # 57 of 64 blocks
    small = [prompt(i, 200, max_tokens=3) for i in range(1, 4)]
    computed = drain(s, [small[0], big, *small[1:]])
    assert s.num_preemptions == 0
    assert computed == 900 + 3 * 200 + 4 * 2
    assert all(r.num_output_tokens == 3 for r in [big, *small])


def test_headroom_counts_what_running_prompts_still_need() -> None:
    s = make(64, budget=64)
    r = prompt(0, 400, max_tokens=2)
    s.add(r)
    out = s.schedule()
    assert out is not None and out.seqs[0].end == 64  # the first chunk: 4 blocks held
    assert kv_capacity(s.cache) == 64
    # 4 held + 22 more to end the prompt and take its next token (401 tokens: 26 blocks)
    assert kv_headroom(s.cache, s.running) == 64 - 26


def one_budget(floor: int) -> tuple[CacheManager, Scheduler]:
    """48 blocks in 12 pages of 4, one budget, the checkpoints' floor at ``floor`` pages."""
    cm = CacheManager(
        CacheManagerConfig(
            block_size=16, num_kv_blocks=48, num_live_slots=6, num_checkpoint_slots=4, checkpoint_bytes=1,
            shared_pages=12, page_blocks=4, kv_block_bytes=1,
        )
    )  # fmt: skip
    assert cm.budget is not None
    cm.budget.floor = floor
    return cm, Scheduler(cm, make_policy("fcfs"), max_num_seqs=6, max_num_batched_tokens=512)


def test_one_budget_keeps_half_the_floor_out_of_admission() -> None:
    """Half of the floor's pages are not KV's to promise: a prompt that fits only with them
    waits (counting every page, it was admitted and the running prompts preempted each other
    for the pages the floor keeps)."""
    cm, s = one_budget(floor=4)  # 16 of the 48 blocks kept for checkpoints, 8 of them reserved
    assert FLOOR_RESERVED == 0.5 and kv_capacity(cm) == 48 - 8
    first, second, third = (
        prompt(0, 400, max_tokens=2),
        prompt(1, 200, max_tokens=2),
        prompt(2, 16, max_tokens=2),
    )
    for r in (first, second, third):
        s.add(r)
    out = s.schedule()
    # 26 blocks to end the first prompt and 13 for the second fit in 40; the third's 2 do not
    assert out is not None and [x.request for x in out.seqs] == [first, second]
    assert third.status is RequestStatus.WAITING
    short = kv_shortfall(cm, s.running, third, lambda: s._match(third))
    assert short == Shortfall(blocks=1, floor_blocks=1)  # the floor's reserved pages alone keep it out
    cm.budget.floor = 0  # type: ignore[union-attr]
    assert kv_shortfall(cm, s.running, third, lambda: s._match(third)) == FITS


def test_a_shortfall_beyond_the_floor_is_not_the_floors() -> None:
    cm, s = one_budget(floor=2)  # 4 blocks reserved
    big, other = prompt(0, 400, max_tokens=2), prompt(1, 250, max_tokens=2)
    s.add(big)
    s.add(other)
    s.schedule()
    assert [r.request_id for r in s.running] == ["r0", "r1"]
    late = prompt(2, 400, max_tokens=2)  # 26 blocks where 44 - 26 - 16 = 2 are left
    # 24 short, more than the 4 reserved blocks: a lower floor would not admit it
    assert kv_shortfall(cm, s.running, late, lambda: s._match(late)) == Shortfall(blocks=24, floor_blocks=0)


def test_a_prompt_kept_out_by_the_floor_alone_charges_it_once_it_has_waited() -> None:
    """A held-back prompt is a KV shortage signal to the floor, like a preemption's recompute:
    after ``FLOOR_WAIT_STEPS`` steps of its wait it lowers the floor by the KV tokens it lacks,
    and only by what grows past that later in the same wait."""
    cm, _ = one_budget(floor=4)
    budget = cm.budget
    assert budget is not None
    req = prompt(0, 160, max_tokens=2)
    page_tokens = 4 * 16  # ``adjust`` moves the floor a page per page of KV tokens
    for _ in range(FLOOR_WAIT_STEPS - 1):
        charge_floor(cm, req, Shortfall(blocks=8, floor_blocks=8))
    assert budget.floor == 4 and budget.balance == 0  # waiting a while is no shortage yet
    charge_floor(cm, req, Shortfall(blocks=8, floor_blocks=8))
    assert budget.floor == 4 - 8 * 16 // page_tokens  # 8 blocks short: two pages
    for _ in range(10):
        charge_floor(cm, req, Shortfall(blocks=8, floor_blocks=8))  # the same shortage
    assert budget.floor == 2
    charge_floor(cm, req, Shortfall(blocks=12, floor_blocks=12))  # 4 more blocks short
    assert budget.floor == 1
    charge_floor(cm, req, Shortfall(blocks=30, floor_blocks=0))  # not the floor's doing
    assert budget.floor == 1 and req.kv_short_blocks == 12


def test_the_wait_starts_over_at_admission() -> None:
    cm, s = one_budget(floor=4)
    first, second = prompt(0, 400, max_tokens=2), prompt(1, 200, max_tokens=2)
    first.kv_short_steps, first.kv_short_blocks = FLOOR_WAIT_STEPS, 5
    s.add(first)
    s.add(second)
    s.schedule()
    assert first.status is RequestStatus.RUNNING and first.kv_short_steps == first.kv_short_blocks == 0


def test_a_fixed_split_reserves_no_floor_and_charges_nothing() -> None:
    s = make(64)
    assert floor_reserved(s.cache) == 0 and kv_capacity(s.cache) == 64
    req = prompt(0, 16, max_tokens=2)
    for _ in range(FLOOR_WAIT_STEPS + 1):
        charge_floor(s.cache, req, Shortfall(blocks=3, floor_blocks=3))
    assert req.kv_short_blocks == 0


def test_the_scheduler_lowers_the_floor_for_a_prompt_it_long_held_back() -> None:
    """End to end: a long decode keeps a short prompt out by the floor's reserved pages alone;
    the floor stays while it waits and drops once it has waited ``FLOOR_WAIT_STEPS`` steps; both
    finish without a preemption (on the old code it was admitted at once, the floor unmoved)."""
    # 36 of 48 blocks promised: half the floor's 6 pages are reserved, the long one's output
    # slot (one page) among them, so lowering the floor frees up to 8 blocks
    cm, s = one_budget(floor=6)
    budget = cm.budget
    assert budget is not None
    long, short = prompt(0, 500, max_tokens=120), prompt(1, 64, max_tokens=2)
    s.add(long)
    held, floors = 0, []
    for _ in range(400):
        if not s.has_work():
            break
        if long.is_decoding and short.request_id not in s.requests:
            s.add(short)  # 32 blocks to end the long one, 5 for this one: 1 past the 36
        step(s)
        if short.status is RequestStatus.WAITING and short.request_id in s.requests:
            held += 1
            floors.append(budget.floor)
    assert short.finish_reason == "length" and long.finish_reason == "length"
    assert s.num_preemptions == 0
    assert held >= FLOOR_WAIT_STEPS
    assert floors[: FLOOR_WAIT_STEPS - 1] == [6] * (FLOOR_WAIT_STEPS - 1)
    # one page down on the step the wait reached FLOOR_WAIT_STEPS (5 blocks short: 80 tokens)
    assert floors[FLOOR_WAIT_STEPS - 1 :] == [5] * (held - FLOOR_WAIT_STEPS + 1)


def test_one_budget_keeps_output_slot_pages_out_of_admission() -> None:
    """A decoding request's output slot holds a page KV cannot take while it runs: admission
    leaves it out of the KV it promises, and a prompt that fits only with it waits for the
    request to finish instead of being admitted and preempting it (the old bound counted the
    page as KV)."""
    cm, s = one_budget(floor=0)
    running = prompt(0, 100, max_tokens=50)
    s.add(running)
    while not cm.ckpts.trackers:  # decode until its output is tracked (a unit boundary)
        out = s.schedule()
        assert out is not None
        s.update(out, [7 if x.samples else None for x in out.seqs])
    assert tracking_held(cm) == 4 and kv_capacity(cm) == 48 - 4
    # 8 blocks held by the decode; 601 tokens take 38 blocks: 2 past the 36 left
    late = prompt(1, 600, max_tokens=2)
    assert kv_shortfall(cm, s.running, late, lambda: s._match(late)) == Shortfall(blocks=2, floor_blocks=0)
    s.add(late)
    for _ in range(400):
        if not s.has_work():
            break
        step(s)
        if running.status is RequestStatus.RUNNING:
            assert late.status is RequestStatus.WAITING
        s.check_integrity()
    assert running.num_output_tokens == 50 and late.num_output_tokens == 2
    assert s.num_preemptions == 0
