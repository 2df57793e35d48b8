"""Loss attribution (``cache/loss.py``): every missed prompt token under exactly one cause.

Each cause is produced by a small scripted scenario and counted exactly; randomized
scheduler-driven workloads (host tier on and off, one budget, preemptions, prompt
log-probability requests, in-flight duplicates) keep ``sum(causes) == misses`` after every step.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from deltaserve.cache import CacheManager, CacheManagerConfig, StepItem
from deltaserve.cache.disk_tier import DiskTier
from deltaserve.cache.loss import MISS_CAUSES, MISS_PREFIX, QUERY_CAUSES, record_capacity
from deltaserve.cache.types import AdmitStatus, PrefixMatch
from deltaserve.scheduler import Request, Scheduler, make_policy

from .test_admit_request import admit
from .test_disk_tier import BS, CKPT_BYTES, KV_BYTES, DictStore, Runner, serve
from .test_manager import make, run_prefill

TOKS = list(range(100))  # 6 full blocks of 16 (96 tokens) and 4 more


def misses(cm: CacheManager) -> dict[str, int]:
    """The causes with tokens, and the identity checked against the query counters."""
    s = cm.stats()
    out = {c: int(s[MISS_PREFIX + c]) for c in MISS_CAUSES if s[MISS_PREFIX + c]}
    assert sum(int(s[MISS_PREFIX + c]) for c in QUERY_CAUSES) == (
        s["prefix_cache.query_tokens"] - s["prefix_cache.hit_tokens"]
    )
    cm.check_integrity()
    return out


def ask(cm: CacheManager, rid: str, toks: list[int] = TOKS, **kw: Any) -> int:
    """Admit ``toks`` whole (``admit_request``); the hit."""
    a = admit(cm, rid, toks, len(toks), **kw)
    assert a.status is AdmitStatus.ADMITTED and a.seq is not None
    return a.seq.num_cached_tokens


def test_a_cold_prompt_is_cold_but_its_last_partial_block() -> None:
    cm = make()
    assert ask(cm, "a") == 0
    assert misses(cm) == {"cold": 96, "granularity": 4}


def test_a_hit_leaves_only_the_tail_it_cannot_serve() -> None:
    cm = make()
    run_prefill(cm, "a", TOKS)  # tail checkpoint at 96
    assert ask(cm, "b") == 96
    assert misses(cm) == {"granularity": 4}


def test_kv_evicted_from_the_device_counts_by_that_tier() -> None:
    cm = make()
    run_prefill(cm, "a", TOKS)
    while (leaf := cm.tree.peek_evictable_leaf()) is not None:
        cm.tiers.evict_leaf(leaf)
    assert cm.tree.num_nodes == 0
    assert ask(cm, "b") == 0
    assert misses(cm) == {"kv_evicted_device": 96, "granularity": 4}


def test_kv_evicted_from_the_host_counts_by_that_tier() -> None:
    cm = make(num_host_kv_blocks=16, num_host_checkpoint_slots=4)
    run_prefill(cm, "a", TOKS)
    while (leaf := cm.tree.peek_evictable_leaf()) is not None:
        cm.tiers.evict_leaf(leaf)  # demoted: the leaf ends a checkpoint, the rest hold host nodes
    cm.commit_step(cm.plan_step([]))  # the saves land
    assert cm.tree.num_nodes == 6 and all(n.block_id < 0 for n in cm.tree.nodes())
    while cm.host.evict_leaf():
        pass
    assert cm.tree.num_nodes == 0
    assert ask(cm, "b") == 0
    assert misses(cm) == {"kv_evicted_host": 96, "granularity": 4}


def test_a_forgotten_eviction_counts_as_cold() -> None:
    cm = make()
    cm.loss.evicted.capacity = 2  # leaves go first: the record keeps the two shallowest blocks
    run_prefill(cm, "a", TOKS)
    while (leaf := cm.tree.peek_evictable_leaf()) is not None:
        cm.tiers.evict_leaf(leaf)
    ask(cm, "b")
    assert misses(cm) == {"kv_evicted_device": 32, "cold": 64, "granularity": 4}


def test_kv_there_without_a_checkpoint_never_captured() -> None:
    cm = make(checkpoint_policy="none")
    run_prefill(cm, "a", TOKS)
    assert ask(cm, "b") == 0
    assert misses(cm) == {"checkpoint_never_captured": 96, "granularity": 4}


def test_kv_there_with_its_capture_skipped_by_the_staging_budget() -> None:
    cm = make(staging_bytes=0)
    run_prefill(cm, "a", TOKS)
    assert cm.stats()["checkpoints.skipped_budget"] > 0
    assert ask(cm, "b") == 0
    assert misses(cm) == {"checkpoint_skipped": 96, "granularity": 4}


def test_kv_there_with_its_checkpoint_evicted() -> None:
    cm = make()
    run_prefill(cm, "a", TOKS[:68])  # tail checkpoint at 64
    run_prefill(cm, "b", TOKS)  # its tail at 96, over the hit at 64
    node = cm.match(TOKS, b"s").path[5]
    cm.ckpts.evict(node)
    assert ask(cm, "c") == 64
    # the deepest boundary with an outcome decides: the checkpoint at 96 evicted
    assert misses(cm) == {"checkpoint_evicted": 32, "granularity": 4}


def test_a_prompt_another_request_computes_now_is_in_flight() -> None:
    cm = make()
    first = admit(cm, "a", TOKS, 64)
    assert first.seq is not None
    cm.commit_step(cm.plan_step([StepItem(first.seq, TOKS, 0, 64, False)]))
    # 4 blocks published without a checkpoint (its tail comes at 96), 2 more still to compute
    assert ask(cm, "b") == 0
    assert misses(cm) == {"cold": 96, "granularity": 8, "in_flight": 96}


def test_a_prompt_logprobs_request_gives_up_its_hit() -> None:
    cm = make()
    run_prefill(cm, "a", TOKS)
    m = cm.match(TOKS, b"s", key="b")
    zero = PrefixMatch(m.path, 0, m.hashes, m.num_tokens, m.version, m.block_size)  # as the scheduler
    a = cm.admit_request(
        "b", TOKS, b"s", zero, lambda hit: 100, prompt_len=100, hashes=m.hashes, whole_prompt=True
    )
    assert a.status is AdmitStatus.ADMITTED and a.start == 0
    assert misses(cm) == {"prompt_logprobs": 96, "granularity": 4}


def test_a_preempted_request_recomputes_outside_the_query() -> None:
    cm = make()
    run_prefill(cm, "a", TOKS[:64] + [999] * 4)  # tail checkpoint at 64
    assert ask(cm, "b", preempted_tokens=80) == 64
    assert cm.stats()["prefix_cache.query_tokens"] == 0  # a return is no query
    assert misses(cm) == {"preemption": 16}


def restarted(store: DictStore, **disk: Any) -> CacheManager:
    """A manager over ``store`` (empty tree), its disk tier with ``disk`` options."""
    cm = CacheManager(
        CacheManagerConfig(
            block_size=BS, num_kv_blocks=40, num_live_slots=2, num_checkpoint_slots=4,
            checkpoint_bytes=CKPT_BYTES, kv_block_bytes=KV_BYTES,
        )
    )  # fmt: skip
    cm.attach_disk(
        DiskTier(
            store, block_size=BS, unit_blocks=1, kv_block_bytes=KV_BYTES, checkpoint_bytes=CKPT_BYTES, **disk
        )
    )
    return cm


def written(store: DictStore) -> None:
    from .test_disk_tier import manager

    first = Runner(manager(store), store)
    serve(first, "a", TOKS)  # on disk: 4 KV blocks and the checkpoint at 64 (chunk granularity)


def test_a_disk_hit_refused_by_the_read_budget() -> None:
    store = DictStore()
    written(store)
    cm = restarted(store, read_buffer_bytes=1)
    assert ask(cm, "b") == 0
    assert cm.stats()["disk.fetch_refused"] == 1
    # the disk holds the KV of its checkpoint's path only; a restarted cache remembers nothing
    assert misses(cm) == {"read_budget": 64, "cold": 32, "granularity": 4}


class StuckStore(DictStore):
    """Reads block until released."""

    def __init__(self, items: DictStore) -> None:
        super().__init__()
        self.items, self.parents = items.items, items.parents
        self.release = threading.Event()

    def read(self, kind: Any, key: int) -> bytes | None:
        self.release.wait(10)
        return super().read(kind, key)


def test_a_disk_hit_past_its_deadline_is_a_disk_wait() -> None:
    store = DictStore()
    written(store)
    stuck = StuckStore(store)
    now = [0.0]
    cm = restarted(stuck, read_timeout_s=1.0, clock=lambda: now[0])
    m = cm.match(TOKS, b"s", key="b")
    first = cm.admit_request("b", TOKS, b"s", m, lambda hit: 100, prompt_len=100, hashes=m.hashes)
    assert first.status is AdmitStatus.WAITING
    now[0] = 5.0  # past the deadline
    try:
        assert ask(cm, "b") == 0
    finally:
        stuck.release.set()
    assert cm.stats()["disk.read_timeouts"] == 1
    assert misses(cm) == {"disk_wait": 64, "cold": 32, "granularity": 4}


def test_record_capacity_bounds() -> None:
    assert record_capacity(10) == 1 << 16 and record_capacity(25_500) == 204_000
    assert record_capacity(10**9) == 1 << 20


@pytest.mark.parametrize("remember_all", [False, True])
def test_a_forgotten_eviction_reads_cold_unless_all_are_remembered(remember_all: bool) -> None:
    cm = make()
    cm.loss.evicted.capacity = 2  # the two evicted last: the prompt's first two blocks
    if remember_all:
        cm.loss.remember_all()
    run_prefill(cm, "a", TOKS)
    while (leaf := cm.tree.peek_evictable_leaf()) is not None:
        cm.tiers.evict_leaf(leaf)
    assert ask(cm, "b") == 0
    if remember_all:
        assert len(cm.loss.evicted) == 6
        assert misses(cm) == {"kv_evicted_device": 96, "granularity": 4}
    else:
        assert len(cm.loss.evicted) == 2
        assert misses(cm) == {"kv_evicted_device": 32, "cold": 64, "granularity": 4}


def test_the_records_hold_the_host_tier_s_blocks_too() -> None:
    # one host budget of checkpoint-sized pages: 10 pages of ceil(1000 / 64) = 16 blocks
    cm = make(num_host_pages=10, checkpoint_bytes=1000, kv_block_bytes=64, num_kv_blocks=10_000)
    assert cm.loss.evicted.capacity == 8 * (10_000 + 160)
    assert cm.loss.outcomes.capacity == cm.loss.evicted.capacity


# ---------------------------------------------------------------------- randomized, via the scheduler
class Params:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens


def scheduler(host: bool, pages: bool, staging: int | None = None) -> Scheduler:
    cfg: dict[str, Any] = dict(
        block_size=16, num_kv_blocks=48, num_live_slots=6, num_checkpoint_slots=4, checkpoint_bytes=1,
        staging_bytes=staging,
    )  # fmt: skip
    if host:
        cfg.update(num_host_kv_blocks=40, num_host_checkpoint_slots=6)
    if pages:  # one budget: 12 pages of 4 blocks
        cfg.update(shared_pages=12, page_blocks=4, kv_block_bytes=1)
    cm = CacheManager(CacheManagerConfig(**cfg))
    # first chunks admitted side by side (no whole-prompt reservation, scheduler/kv_reserve.py):
    # prompts then outgrow the pool and preempt each other, and the recompute is a cause too
    return Scheduler(
        cm, make_policy("fcfs", {}), max_num_seqs=6, max_num_batched_tokens=160, reserve_prompts=False
    )


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("pages", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_causes_sum_to_misses_after_every_step(host: bool, pages: bool, seed: int) -> None:
    rng = random.Random(seed)
    s = scheduler(host, pages, staging=1 if seed else None)  # one capture a step: the rest skipped
    cm = s.cache
    done: list[Request] = []
    n = 0
    for _ in range(600):
        if len(s.waiting) < 3 and rng.random() < 0.5:
            kind = rng.random()
            if done and kind < 0.5:  # the next turn of a finished conversation
                prev = rng.choice(done)
                toks = prev.token_ids + [rng.randrange(50_000) for _ in range(rng.randint(1, 40))]
            elif (s.running or s.waiting) and kind < 0.65:  # the same prompt, in flight
                toks = list(rng.choice(s.running + s.waiting).prompt_token_ids)
            else:
                toks = [rng.randrange(3) * 1000 + i for i in range(rng.randint(20, 120))]
            r = Request(f"r{n}", toks[:300], Params(rng.randint(1, 12)))
            r.compute_whole_prompt = rng.random() < 0.1
            s.add(r)
            n += 1
        out = s.schedule()
        if out is None:
            continue
        s.update(out, [7 if x.samples else None for x in out.seqs])
        for x in out.seqs:
            r = x.request
            if x.samples and r.num_output_tokens >= r.sampling_params.max_tokens:
                s.finish(r, "length")
                done.append(r)
        s.check_integrity()  # the identity, in check_integrity
        misses(cm)
    seen = misses(cm)
    assert {"cold", "granularity", "kv_evicted_device", "checkpoint_evicted", "prompt_logprobs"} <= set(seen)
    assert ("kv_evicted_host" in seen) == host
    assert "preemption" not in seen or s.num_preemptions > 0
