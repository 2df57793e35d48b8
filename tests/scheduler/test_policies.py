"""Scheduling policies (order, victims, aging) and the scheduler's chunking/preemption, torch-free."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from deltaserve.cache import CacheManager, CacheManagerConfig, CaptureKind
from deltaserve.engine import ConfigError, EngineConfig
from deltaserve.engine.cli import add_config_args, config_from_args
from deltaserve.scheduler import PolicyContext, Request, Scheduler, SchedulingPolicy, make_policy


class Params:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens


def req(rid: str, n: int, *, t: float, prio: int = 0, step: int = 0, max_tokens: int = 4) -> Request:
    r = Request(
        rid, list(range(1000 * len(rid) + n, 1000 * len(rid) + 2 * n)), Params(max_tokens), priority=prio
    )
    r.arrival_time = t
    r.arrival_step = step
    return r


def ctx(step: int = 0, hits: dict[str, int] | None = None) -> PolicyContext:
    return PolicyContext(step=step, now=0.0, cached_prefix=lambda r: (hits or {}).get(r.request_id, 0))


QUEUE = [
    req("a", 300, t=1),
    req("b", 50, t=2, prio=2),
    req("c", 120, t=3, prio=-1),
    req("d", 50, t=4, prio=2),
]


def ids(rs: list[Request]) -> list[str]:
    return [r.request_id for r in rs]


def test_fcfs_order_and_victim() -> None:
    p = make_policy("fcfs")
    assert ids(p.order_waiting(QUEUE[::-1], ctx())) == ["a", "b", "c", "d"]
    assert p.preemption_victim(QUEUE, ctx()).request_id == "d"


def test_priority_order_victim_and_aging() -> None:
    p = make_policy("priority", {"aging_steps": 10})
    assert ids(p.order_waiting(QUEUE, ctx())) == ["c", "a", "b", "d"]
    assert p.preemption_victim(QUEUE, ctx()).request_id == "d"  # worst priority, latest
    old_low = req("old", 10, t=0, prio=5, step=0)
    new_high = req("new", 10, t=9, prio=0, step=100)
    # after 100 steps the old prio-5 request is effectively prio -5: ahead of a fresh prio 0
    assert ids(p.order_waiting([new_high, old_low], ctx(step=100))) == ["old", "new"]
    # exact integer arithmetic: a fraction of a level still counts, any int priority is safe
    assert p.effective(old_low, ctx(step=15)) == Fraction(7, 2)  # type: ignore[attr-defined]
    assert p.effective(req("huge", 5, t=0, prio=10**400), ctx(step=10)) == 10**400 - 1  # type: ignore[attr-defined]


def test_lpm_order_and_fallback() -> None:
    p = make_policy("lpm", {"max_queue": 3, "aging_tokens_per_step": 0})
    hits = {"a": 0, "b": 64, "c": 128, "d": 64}
    assert ids(p.order_waiting(QUEUE[:3], ctx(hits=hits))) == ["c", "b", "a"]
    assert ids(p.order_waiting(QUEUE, ctx(hits=hits))) == ["a", "b", "c", "d"]  # 4 > max_queue: FCFS
    assert p.stats()["lpm_fcfs_fallbacks"] == 1
    # aging: 8 virtual tokens per step waited; a hit of 512 outranks a miss that waited
    # 64 steps longer, not one that waited 100 steps longer
    aged = make_policy("lpm", {"aging_tokens_per_step": 8.0})
    old_miss = req("old", 10, t=0, step=0)
    hits = {"old": 0, "new": 512}
    recent_hit = req("new", 10, t=9, step=40)
    assert ids(aged.order_waiting([recent_hit, old_miss], ctx(step=150, hits=hits))) == ["new", "old"]
    late_hit = req("new", 10, t=9, step=100)
    assert ids(aged.order_waiting([late_hit, old_miss], ctx(step=150, hits=hits))) == ["old", "new"]


def test_sjf_order_aging_and_victim() -> None:
    p = make_policy("sjf", {"aging_tokens_per_step": 1.0})
    assert ids(p.order_waiting(QUEUE, ctx())) == ["b", "d", "c", "a"]
    assert ids(p.order_waiting(QUEUE, ctx(step=0))) == ["b", "d", "c", "a"]
    big_old = req("big", 300, t=0, step=0)
    small_new = req("small", 20, t=5, step=290)
    assert ids(p.order_waiting([small_new, big_old], ctx(step=300))) == ["big", "small"]
    assert p.preemption_victim(QUEUE, ctx()).request_id == "a"


def test_unknown_policy_lists_known_ones() -> None:
    with pytest.raises(
        ConfigError, match="scheduler.policy = 'nope': unknown policy; known: fcfs, lpm, priority, sjf"
    ):
        EngineConfig.load(None, {"scheduler.policy": "nope"})
    with pytest.raises(TypeError, match="takes no options"):
        make_policy("fcfs", {"x": 1})


def test_config_file_and_set_switch_policy(tmp_path: Path) -> None:
    import argparse

    toml = tmp_path / "a.toml"
    toml.write_text('[scheduler]\npolicy = "lpm"\n[scheduler.policy_options]\nmax_queue = 7\n')
    cfg = EngineConfig.load(toml)
    assert cfg.scheduler.policy == "lpm" and cfg.scheduler.policy_options == {"max_queue": 7}
    assert make_policy(cfg.scheduler.policy, cfg.scheduler.policy_options).max_queue == 7  # type: ignore[attr-defined]
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(
        ["--config", str(toml), "--set", "scheduler.policy=priority", "--set", "scheduler.policy_options={}"]
    )
    assert config_from_args(args).scheduler.policy == "priority"
    js = tmp_path / "b.json"
    js.write_text(json.dumps({"scheduler": {"policy": "tests.scheduler.custom_policy:LongestFirst"}}))
    cfg = EngineConfig.load(js)
    policy = make_policy(cfg.scheduler.policy, cfg.scheduler.policy_options)
    assert ids(policy.order_waiting(QUEUE, ctx())) == ["a", "c", "b", "d"]
    yml = tmp_path / "c.yaml"
    yml.write_text("scheduler:\n  policy: sjf\n  max_num_seqs: 3\n")
    assert EngineConfig.load(yml).scheduler.max_num_seqs == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"scheduler.max_num_seqs": 0}, r"scheduler.max_num_seqs = 0: Expected `int` >= 1"),
        (
            {"scheduler.max_num_seqs": "many"},
            r"scheduler.max_num_seqs = 'many': Expected `int \| null`|scheduler.max_num_seqs = 'many': Expected `int`",
        ),
        ({"cache.block_size": -16}, r"cache.block_size = -16: Expected `int` >= 1"),
        ({"model.dtype": "fp8"}, r"model.dtype = 'fp8': expected one of float32, bfloat16, float16, auto"),
        ({"cache.bogus": 1}, r"cache.bogus: unknown key"),
        ({"kernels.backend": "cuda"}, r"kernels.backend = 'cuda': expected one of auto, reference, triton"),
        ({"cache.checkpoint_policy": "x"}, r"cache.checkpoint_policy = 'x': unknown; known: default"),
    ],
)
def test_bad_config_values_name_key_and_value(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.load(None, overrides)


# ---------------------------------------------------------------------- scheduler simulation
def make_scheduler(
    policy: str | SchedulingPolicy = "fcfs",
    *,
    blocks: int = 400,
    seqs: int = 16,
    budget: int = 512,
    wait: int = 0,
    **opts: Any,
) -> Scheduler:
    """Real Scheduler + CacheManager (torch-free) with a policy given by name or instance."""
    cm = CacheManager(
        CacheManagerConfig(
            block_size=16,
            num_kv_blocks=blocks,
            num_live_slots=seqs,
            num_checkpoint_slots=8,
            checkpoint_bytes=1,
        )
    )
    chosen = make_policy(policy, opts) if isinstance(policy, str) else policy
    return Scheduler(
        cm, chosen, max_num_seqs=seqs, max_num_batched_tokens=budget, shared_prefix_wait_tokens=wait
    )


def sim_step(s: Scheduler, finished: list[Request]) -> Any:
    out = s.schedule()
    if out is None:
        return None
    s.update(out, [7 if x.samples else None for x in out.seqs])
    for x in out.seqs:
        r = x.request
        if x.samples and r.num_output_tokens >= r.sampling_params.max_tokens:
            s.finish(r, "length")
            finished.append(r)
    s.check_integrity()
    return out


def test_chunks_end_on_unit_boundaries() -> None:
    s = make_scheduler(budget=200)
    s.add(req("long", 1000, t=0, max_tokens=1))
    done: list[Request] = []
    ends = []
    while s.has_work():
        out = sim_step(s, done)
        ends += [x.end for x in out.seqs]
    assert ends[:-1] == [192, 384, 576, 768, 960] and ends[-1] == 1000


def test_priority_aging_bounds_starvation() -> None:
    s = make_scheduler("priority", seqs=2, budget=128, aging_steps=8)
    low = req("low", 60, t=0, prio=10)
    s.add(low)
    done: list[Request] = []
    # keep the engine saturated with fresh high-priority requests
    for step in range(400):
        while len(s.waiting) < 4:
            s.add(req(f"h{step}-{len(s.waiting)}", 60, t=step + 1, prio=0, max_tokens=3))
        sim_step(s, done)
        if low in done:
            break
    assert low in done, "low-priority request starved"
    assert step < 150


def test_preemption_under_kv_pressure_keeps_everyone_alive() -> None:
    s = make_scheduler(blocks=48, seqs=16, budget=256)
    reqs = [req(f"r{i}", 100 + 10 * i, t=i, max_tokens=40) for i in range(12)]
    for r in reqs:
        s.add(r)
    done: list[Request] = []
    for _ in range(5000):
        if not s.has_work():
            break
        sim_step(s, done)
    assert sorted(ids(done)) == sorted(ids(reqs))
    assert s.num_preemptions > 0
    assert all(r.num_output_tokens == 40 for r in reqs)


def test_long_prefill_does_not_stall_decodes() -> None:
    s = make_scheduler(budget=256)
    decoders = [req(f"d{i}", 30, t=i, max_tokens=200) for i in range(8)]
    for r in decoders:
        s.add(r)
    done: list[Request] = []
    while not all(r.is_decoding for r in decoders):
        sim_step(s, done)
    s.add(req("big", 4000, t=100, max_tokens=2))
    steps = 0
    while s.requests.get("big") is not None and s.requests["big"].num_computed_tokens < 4000:
        out = sim_step(s, done)
        steps += 1
        decoded = {x.request.request_id for x in out.seqs if x.is_decode}
        assert decoded == {r.request_id for r in decoders}, "a decode was stalled by the long prefill"
    assert steps >= 4000 // 256


def test_hit_rate_stats_count_each_request_once_under_kv_pressure() -> None:
    s = make_scheduler(blocks=20, seqs=8, budget=512)
    reqs = [req(f"q{i}", 150, t=i, max_tokens=2) for i in range(3)]
    for r in reqs:
        s.add(r)
    done: list[Request] = []
    while s.has_work():
        sim_step(s, done)
    stats = s.cache.stats()
    assert stats["prefix_cache.queries"] == 3
    assert stats["prefix_cache.query_tokens"] == 450


@pytest.mark.parametrize("wait", [0, 64])
def test_a_burst_on_one_new_prefix_computes_it_once(wait: int) -> None:
    """Three prompts on one new 300-token prefix arrive together. With the wait on, the first
    computes it (and a branch checkpoint at 288, where they part) while the others wait; they
    resume there. Off, all three compute it side by side."""
    s = make_scheduler(budget=2048, wait=wait)
    shared = list(range(5000, 5300))
    for i, rid in enumerate(("a", "b", "c")):
        r = Request(rid, shared + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 40)), Params(1))
        r.arrival_time = float(i)
        s.add(r)
    done: list[Request] = []
    first = sim_step(s, done)
    assert [(x.request.request_id, x.start) for x in first.seqs] == (
        [("a", 0)] if wait else [("a", 0), ("b", 0), ("c", 0)]
    )
    if wait:
        assert sorted((c.boundary, c.kind) for c in first.plan.captures) == [
            (288, CaptureKind.BRANCH),
            (336, CaptureKind.TAIL),
        ]
        second = sim_step(s, done)
        assert [(x.request.request_id, x.start) for x in second.seqs] == [("b", 288), ("c", 288)]
    while s.has_work():
        sim_step(s, done)
    assert sorted(r.request_id for r in done) == ["a", "b", "c"]
    assert s.cache.stats()["prefix_cache.hit_tokens"] == (2 * 288 if wait else 0)


def test_the_wait_ends_when_the_prompt_it_waits_for_leaves() -> None:
    s = make_scheduler(budget=2048, wait=64)
    shared = list(range(5000, 5300))
    s.add(Request("a", shared + [1] * 40, Params(1)))
    s.add(Request("b", shared + [2] * 40, Params(1)))
    out = s.schedule()  # a admitted (its step in flight); b waits for it
    assert out is not None and [r.request_id for r in s.running] == ["a"]
    assert [r.request_id for r in s.waiting] == ["b"]
    assert [r.request_id for r in s.fail_step(out)] == ["a"]  # a's step fails: a ends
    s.check_integrity()
    again = s.schedule()
    assert again is not None and [(x.request.request_id, x.start) for x in again.seqs] == [("b", 0)]


def test_a_prefix_cached_as_kv_only_is_waited_for_while_another_computes_its_checkpoint() -> None:
    """A first request left the shared 300 tokens as KV with its checkpoint past them (at 336).
    Two more arrive together: the first computes the prefix again and leaves a branch checkpoint
    at 288; the second waits a step and resumes there."""
    s = make_scheduler(budget=2048, wait=64)
    shared = list(range(5000, 5300))
    done: list[Request] = []
    s.add(Request("warm", shared + list(range(9000, 9040)), Params(1)))
    while s.has_work():
        sim_step(s, done)
    for i, rid in enumerate(("a", "b")):
        s.add(Request(rid, shared + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 40)), Params(1)))
    first = sim_step(s, done)
    assert [(x.request.request_id, x.start) for x in first.seqs] == [("a", 0)]
    assert (288, CaptureKind.BRANCH) in [(c.boundary, c.kind) for c in first.plan.captures]
    second = sim_step(s, done)
    assert [(x.request.request_id, x.start) for x in second.seqs] == [("b", 288)]
    while s.has_work():
        sim_step(s, done)
    assert sorted(r.request_id for r in done) == ["a", "b", "warm"]
