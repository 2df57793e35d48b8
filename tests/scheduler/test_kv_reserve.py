"""Admission under KV pressure (``scheduler/kv_reserve.py``): long prompts arriving faster than
the device holds them wait for room instead of preempting each other half built. Torch-free."""

from __future__ import annotations

from deltaserve.cache import CacheManager, CacheManagerConfig
from deltaserve.scheduler import Request, Scheduler, make_policy
from deltaserve.scheduler.kv_reserve import kv_capacity, kv_headroom


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
        out = s.schedule()
        assert out is not None, "stuck with waiting requests"
        computed += out.num_tokens
        s.update(out, [7 if x.samples else None for x in out.seqs])
        for x in out.seqs:
            r = x.request
            if x.samples and r.num_output_tokens >= r.sampling_params.max_tokens:
                s.finish(r, "length")
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


def test_one_budget_counts_every_page_the_floor_yields_by_preemption() -> None:
    """The checkpoints' floor is not reserved against: it yields to KV through preemptions
    (their recompute lowers it), which an admission counting it would never cause."""
    cm = CacheManager(
        CacheManagerConfig(
            block_size=16, num_kv_blocks=48, num_live_slots=6, num_checkpoint_slots=4, checkpoint_bytes=1,
            shared_pages=12, page_blocks=4, kv_block_bytes=1,
        )
    )  # fmt: skip
    s = Scheduler(cm, make_policy("fcfs"), max_num_seqs=6, max_num_batched_tokens=512)
    assert cm.budget is not None
    cm.budget.floor = 4  # 16 of the 48 blocks kept for checkpoints
    assert kv_capacity(cm) == 48
    first, second = prompt(0, 400, max_tokens=2), prompt(1, 200, max_tokens=2)
    s.add(first)
    s.add(second)
    out = s.schedule()
    # 26 blocks to end the first prompt and 13 for the second fit in 48: both admitted
    assert out is not None and [x.request for x in out.seqs] == [first, second]
