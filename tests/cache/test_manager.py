"""CacheManager: joint hits, captures, staging, pinning, eviction, integrity."""

from __future__ import annotations

import pytest

from deltaserve.cache import CacheManager, CacheManagerConfig, CaptureKind, SlotState, StepItem
from deltaserve.cache.v1_eviction import V1Eviction

from .helpers import lookup


def make(**kw: object) -> CacheManager:
    cfg = dict(
        block_size=16, num_kv_blocks=64, num_live_slots=4, num_checkpoint_slots=8, checkpoint_bytes=100
    )
    cfg.update(kw)
    return CacheManager(CacheManagerConfig(**cfg))  # type: ignore[arg-type]


def run_prefill(cm: CacheManager, rid: str, toks: list[int], chunk: int = 10_000) -> None:
    """Admit and compute all of ``toks`` in block-aligned chunks, then free."""
    seq = cm.admit(rid, toks, b"s")
    assert seq is not None
    start = seq.num_cached_tokens
    while start < len(toks):
        end = min(len(toks), start + chunk)
        if end < len(toks):
            end = end // cm.unit * cm.unit
        assert cm.allocate(seq, end)
        plan = cm.plan_step([StepItem(seq, toks, start, end, False)])
        cm.commit_step(plan)
        cm.check_integrity()
        start = end
    cm.free(seq)
    cm.check_integrity()


def test_unit_is_the_block_and_intervals_stay_on_the_chunk_grid() -> None:
    assert make(block_size=16).unit == 16 and make(block_size=48).unit == 48
    assert make(checkpoint_interval=100).interval == 128  # lcm(16, 64) = 64
    assert make(block_size=48, checkpoint_interval=100).interval == 192  # lcm(48, 64) = 192
    assert make(has_gdn=False, checkpoint_interval=100).interval == 112


def test_tail_checkpoint_gives_next_turn_a_hit() -> None:
    cm = make()
    turn1 = list(range(300))
    run_prefill(cm, "t1", turn1)
    # tail = deepest block boundary <= 299 -> 288
    turn2 = turn1 + list(range(1000, 1100))
    assert lookup(cm, turn2, b"s") == 288
    assert cm.stats()["checkpoints.stored"] == 1


def test_hit_never_covers_the_last_prompt_token() -> None:
    cm = make()
    toks = list(range(256))
    run_prefill(cm, "a", toks)
    # 256 tokens: tail = 240 (boundary <= 255); the hit for the same prompt is at most 255
    assert lookup(cm, toks, b"s") == 240


def test_kv_without_checkpoint_is_no_hybrid_hit_but_is_a_plain_hit() -> None:
    toks = list(range(200))
    hybrid = make(checkpoint_policy="none")
    run_prefill(hybrid, "a", toks)
    assert lookup(hybrid, toks + [1], b"s") == 0
    plain = make(has_gdn=False)
    run_prefill(plain, "a", toks)
    assert lookup(plain, toks + [1], b"s") == 192  # 12 full blocks


def test_salt_separates_caches() -> None:
    cm = make()
    run_prefill(cm, "a", list(range(300)))
    assert lookup(cm, list(range(300)) + [7], b"other") == 0


def test_branch_capture_at_divergence() -> None:
    cm = make(checkpoint_interval=0)
    shared = list(range(150))
    run_prefill(cm, "a", shared + list(range(500, 700)))  # tail at 336, nothing at 144
    b = cm.admit("b", shared + list(range(900, 1100)), b"s")
    assert b is not None and b.num_cached_tokens == 0 and b.branch_boundary == 144
    toks = shared + list(range(900, 1100))
    assert cm.allocate(b, len(toks))
    plan = cm.plan_step([StepItem(b, toks, 0, len(toks), False)])
    assert sorted((c.boundary, c.kind, c.tracking) for c in plan.captures) == [
        (144, CaptureKind.BRANCH, False),
        (336, CaptureKind.TAIL, False),
    ]
    cm.commit_step(plan)
    cm.free(b)
    cm.check_integrity()
    assert lookup(cm, shared + [4242] * 50, b"s") == 144


def test_staging_budget_and_pool_skips_are_counted() -> None:
    cm = make(staging_bytes=0)
    run_prefill(cm, "a", list(range(300)))
    assert cm.stats()["checkpoints.skipped_budget"] == 1
    assert cm.stats()["checkpoints.stored"] == 0
    cm = make(num_checkpoint_slots=0)
    run_prefill(cm, "a", list(range(300)))
    assert cm.stats()["checkpoints.skipped_pool"] == 1


def test_checkpoint_lru_eviction_when_pool_is_short() -> None:
    cm = make(
        num_checkpoint_slots=1, num_kv_blocks=200, checkpoint_policy="interval", checkpoint_interval=256
    )
    run_prefill(cm, "a", list(range(300)))
    run_prefill(cm, "b", list(range(1000, 1300)))
    s = cm.stats()
    assert s["checkpoints.stored"] == 2 and s["checkpoints.evicted"] == 1
    assert lookup(cm, list(range(300)) + [1], b"s") == 0
    assert lookup(cm, list(range(1000, 1300)) + [1], b"s") == 256


def test_pinned_restore_source_survives_pool_pressure() -> None:
    cm = make(num_checkpoint_slots=1, num_kv_blocks=200, checkpoint_policy="v1")
    run_prefill(cm, "a", list(range(300)))
    seq = cm.admit("b", list(range(300)) + [9] * 20, b"s")
    assert seq is not None and seq.restore_node is not None
    # another request wants a capture; the only checkpoint is pinned by the pending restore
    other = list(range(2000, 2300))
    o = cm.admit("c", other, b"s")
    assert o is not None and cm.allocate(o, 300) and cm.allocate(seq, 320)
    plan = cm.plan_step(
        [StepItem(seq, list(range(300)) + [9] * 20, 256, 320, False), StepItem(o, other, 0, 300, False)]
    )
    assert plan.restores == [(seq.restore_node.checkpoint_slot, seq.state_slot)]
    assert cm.stats()["checkpoints.skipped_pool"] >= 1
    cm.commit_step(plan)
    cm.check_integrity()


def test_kv_eviction_prefers_leaves_without_checkpoints() -> None:
    cm = make(num_kv_blocks=43, checkpoint_interval=0)
    run_prefill(cm, "a", list(range(304)))  # 19 blocks, tail checkpoint at 288 (block 18)
    run_prefill(cm, "b", list(range(1000, 1112)), chunk=64)  # 7 blocks, tail checkpoint at 96
    seq = cm.admit("c", list(range(5000, 5300)), b"s")
    assert seq is not None
    assert cm.allocate(seq, 300)  # needs 19, 17 free -> evicts the 2 checkpoint-less leaves
    assert lookup(cm, list(range(304)) + [1], b"s") == 288
    assert lookup(cm, list(range(1000, 1112)) + [1], b"s") == 96
    assert cm.stats()["kv.evicted_blocks"] == 2
    cm.check_integrity()


def test_allocate_fails_cleanly_when_everything_is_pinned() -> None:
    cm = make(num_kv_blocks=10)
    a = cm.admit("a", list(range(100)), b"s")
    assert a is not None and cm.allocate(a, 100)  # 7 blocks
    b = cm.admit("b", list(range(200, 300)), b"s")
    assert b is not None and not cm.allocate(b, 100)
    assert len(b.block_table) == 0
    cm.check_integrity()


def test_output_tracking_checkpoint_published_on_finish() -> None:
    cm = make(checkpoint_interval=0)
    toks = list(range(100))
    seq = cm.admit("a", toks, b"s")
    assert seq is not None and cm.allocate(seq, 100)
    cm.commit_step(cm.plan_step([StepItem(seq, toks, 0, 100, False)]))
    # decode until 130 tokens: crosses the block boundaries 112 and 128
    for n in range(100, 130):
        toks.append(n + 10_000)
        assert cm.allocate(seq, n + 1)
        plan = cm.plan_step([StepItem(seq, toks, n, n + 1, True)])
        if n + 1 in (112, 128):
            assert plan.decode_copies == [(seq.state_slot, seq.tracking_slot)]
            assert cm.slots.ckpt_state[seq.tracking_slot] is SlotState.TRACKING
        else:
            assert plan.decode_copies == []
        cm.commit_step(plan)
        cm.check_integrity()
    cm.free(seq)
    cm.check_integrity()
    assert lookup(cm, toks + [1, 2, 3], b"s") == 128


def test_failed_step_releases_reservations() -> None:
    cm = make()
    toks = list(range(300))
    seq = cm.admit("a", toks, b"s")
    assert seq is not None and cm.allocate(seq, 300)
    plan = cm.plan_step([StepItem(seq, toks, 0, 300, False)])
    assert plan.reserved
    cm.check_integrity()
    cm.abort_step(plan)
    cm.free(seq, publish_output=False)
    cm.check_integrity()
    assert cm.slots.num_free_checkpoint == cm.slots.num_checkpoint
    assert cm.blocks.num_free == cm.blocks.num_blocks


def test_duplicate_blocks_are_shared() -> None:
    cm = make()
    toks = list(range(200))
    a = cm.admit("a", toks, b"s")
    b = cm.admit("b", toks, b"s")
    assert a is not None and b is not None and cm.allocate(a, 200) and cm.allocate(b, 200)
    cm.commit_step(cm.plan_step([StepItem(a, toks, 0, 200, False), StepItem(b, toks, 0, 200, False)]))
    assert a.block_table[:12] == b.block_table[:12]
    assert cm.stats()["checkpoints.duplicate"] == 1
    cm.check_integrity()
    cm.free(a)
    cm.free(b)
    cm.check_integrity()


def test_disabled_cache_never_hits() -> None:
    cm = make(enable_prefix_caching=False)
    run_prefill(cm, "a", list(range(300)))
    assert lookup(cm, list(range(300)), b"s") == 0
    assert cm.blocks.num_free == cm.blocks.num_blocks


def test_unknown_policy_names_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown checkpoint policy 'nope'; known: default, every-unit"):
        make(checkpoint_policy="nope")


def test_v1_tail_never_evicts_a_live_checkpoint_but_output_may() -> None:
    cm = make(num_checkpoint_slots=1, num_kv_blocks=200, checkpoint_interval=0, checkpoint_policy="v1")
    run_prefill(cm, "a", list(range(300)))  # the one slot: tail checkpoint at 288 (live)
    toks = list(range(1000, 1300))
    seq = cm.admit("b", toks, b"s")
    assert seq is not None and cm.allocate(seq, 300)
    plan = cm.plan_step([StepItem(seq, toks, 0, 300, False)])
    assert plan.captures == [] and cm.stats()["checkpoints.skipped_pool"] == 1
    cm.commit_step(plan)
    assert lookup(cm, list(range(300)) + [1], b"s") == 288  # still there
    cm.free(seq)
    cm.check_integrity()


def test_v1_deeper_checkpoint_demotes_the_chain_above() -> None:
    cm = make(num_checkpoint_slots=3, num_kv_blocks=200, checkpoint_interval=64, checkpoint_policy="v1")
    toks = list(range(200))
    run_prefill(cm, "a", toks)  # interval checkpoints at 64, 128 and the tail at 192
    nodes = {n.depth * 16: n for n in cm.tree.nodes() if n.checkpoint_slot is not None}
    assert sorted(nodes) == [64, 128, 192]
    assert V1Eviction.is_demoted(nodes[64]) and V1Eviction.is_demoted(nodes[128])
    assert not V1Eviction.is_demoted(nodes[192])


def test_extending_a_leaf_is_not_a_branch_but_diverging_from_a_live_path_is() -> None:
    cm = make(checkpoint_interval=0)
    turn1 = list(range(300))
    run_prefill(cm, "t1", turn1)  # tail checkpoint at 288, where the path ends (leaf)
    nxt = cm.admit("t2", turn1 + list(range(500, 600)), b"s")
    assert nxt is not None and nxt.num_cached_tokens == 288 and nxt.branch_boundary == 0
    cm.free(nxt, publish_output=False)
    # a prompt leaving turn1's path at 200 while the path goes on: proven shared at 192
    side = cm.admit("t3", turn1[:200] + list(range(700, 800)), b"s")
    assert side is not None and side.num_cached_tokens == 0 and side.branch_boundary == 192
    cm.free(side, publish_output=False)
    cm.check_integrity()


def test_concurrent_prompts_sharing_an_unpublished_prefix_branch() -> None:
    cm = make(checkpoint_interval=0)
    shared = list(range(150))
    a = cm.admit("a", shared + list(range(500, 600)), b"s")
    b = cm.admit("b", shared + list(range(900, 1000)), b"s")
    assert a is not None and b is not None
    assert a.branch_boundary == 0  # nothing known when it arrived
    assert b.branch_boundary == 144  # shares 9 full blocks with a's prompt in flight
    cm.free(a, publish_output=False)
    cm.free(b, publish_output=False)
    cm.check_integrity()


def test_v1_speculative_capture_never_evicts_a_proven_checkpoint() -> None:
    cm = make(num_checkpoint_slots=1, num_kv_blocks=300, checkpoint_interval=0, checkpoint_policy="v1")
    shared = list(range(150))
    run_prefill(cm, "a", shared + list(range(500, 600)))  # tail at 240: the one slot
    b_toks = shared + list(range(900, 1000))
    b = cm.admit("b", b_toks, b"s")
    assert b is not None and b.branch_boundary == 144
    assert cm.allocate(b, len(b_toks))
    cm.commit_step(cm.plan_step([StepItem(b, b_toks, 0, len(b_toks), False)]))
    cm.free(b)
    branch_node = next(n for n in cm.tree.nodes() if n.checkpoint_slot is not None)
    assert branch_node.depth * 16 == 144 and branch_node.policy_state.protected  # the branch evicted a's tail
    # an unrelated request's output tracking (speculative) may not displace it
    c_toks = list(range(3000, 3100))
    c = cm.admit("c", c_toks, b"s")
    assert c is not None and cm.allocate(c, 100)
    cm.commit_step(cm.plan_step([StepItem(c, c_toks, 0, 100, False)]))
    for n in range(100, 130):
        c_toks.append(n)
        assert cm.allocate(c, n + 1)
        cm.commit_step(cm.plan_step([StepItem(c, c_toks, n, n + 1, True)]))
    assert c.tracking_slot == -1 and cm.stats()["checkpoints.skipped_pool"] >= 1
    cm.free(c)
    assert lookup(cm, shared + [1] * 30, b"s") == 144
    cm.check_integrity()


@pytest.mark.parametrize("free_slot", [True, False])
def test_a_prompt_waits_for_one_computing_its_prefix_and_asks_a_branch_only_with_room(
    free_slot: bool,
) -> None:
    cm = make(num_checkpoint_slots=1, checkpoint_interval=0)
    if not free_slot:
        run_prefill(cm, "old", list(range(7000, 7100)))  # the one slot: its tail checkpoint
    shared = list(range(150))
    a = cm.admit("a", shared + list(range(500, 600)), b"s")
    assert a is not None and a.branch_boundary == 0
    b_toks = shared + list(range(900, 1000))
    m = cm.match(b_toks, b"s")
    assert not cm.wait_for_shared_prefix(m, b_toks, 145)  # 144 shared tokens: less than asked for
    assert cm.wait_for_shared_prefix(m, b_toks, 64)
    # with a free slot, a captures where the prompts part; with none, nothing is displaced for it
    assert a.branch_boundary == (144 if free_slot else 0)
    cm.free(a, publish_output=False)
    assert not cm.wait_for_shared_prefix(cm.match(b_toks, b"s"), b_toks, 64)  # nobody computes it now
    cm.check_integrity()
