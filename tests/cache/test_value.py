"""The value model: learned reuse per capture kind, admission by value, cycle resistance,
marginal savings, tracking slots that give way, and the learner's bookkeeping."""

from __future__ import annotations

import random

import pytest

from deltaserve.cache import (
    CacheManager,
    CacheManagerConfig,
    CaptureKind,
    CheckpointGranularity,
    PrefixMatch,
    StepItem,
)
from deltaserve.cache.eviction import CostModel, EvictionParams, Want
from deltaserve.cache.host_order import DOMINATED, band
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.reuse import ReuseLearner, _bounds, _bucket
from deltaserve.cache.value_eviction import ValueEviction, ValueState

from .helpers import lookup


def make(**kw: object) -> CacheManager:
    cfg = dict(
        block_size=16,
        num_kv_blocks=4096,
        num_live_slots=8,
        num_checkpoint_slots=4,
        checkpoint_bytes=100,
        checkpoint_interval=0,
        checkpoint_granularity=CheckpointGranularity.CHUNK,
    )
    # chunk granularity: the boundaries below are multiples of 64 (what is tested does not depend on it;
    # test_manager.py covers block granularity)
    cfg.update(kw)
    return CacheManager(CacheManagerConfig(**cfg))  # type: ignore[arg-type]


def serve(cm: CacheManager, rid: str, prompt: list[int], reply: list[int]) -> int:
    """Admit, prefill, decode ``reply`` token by token, finish; returns the hit."""
    toks = list(prompt)
    seq = cm.admit(rid, toks, b"s")
    assert seq is not None
    cm.record_query(len(toks), seq.num_cached_tokens, seq)
    start = seq.num_cached_tokens
    assert cm.allocate(seq, len(toks))
    cm.commit_step(cm.plan_step([StepItem(seq, toks, start, len(toks), False)]))
    cm.check_integrity()
    for tok in reply[:-1]:
        toks.append(tok)
        n = len(toks)
        assert cm.allocate(seq, n)
        cm.commit_step(cm.plan_step([StepItem(seq, toks, n - 1, n, True)]))
    cm.free(seq)
    cm.check_integrity()
    return seq.num_cached_tokens


def conversations(cm: CacheManager, n_conv: int, turns: int, *, model_replies: bool, seed: int = 0) -> float:
    """``n_conv`` conversations served round-robin; hit rate over all prompt tokens."""
    rng = random.Random(seed)
    prompts = [[1000 * (c + 1) + i for i in range(200 + 40 * c)] for c in range(n_conv)]
    hit = total = 0
    for t in range(turns):
        for c in range(n_conv):
            reply = [rng.randrange(50_000, 60_000) for _ in range(80)]
            h = serve(cm, f"c{c}t{t}", prompts[c], reply)
            if t:
                hit, total = hit + h, total + len(prompts[c])
            resent = reply if model_replies else [rng.randrange(60_000, 70_000) for _ in range(80)]
            prompts[c] = prompts[c] + resent + [rng.randrange(70_000, 80_000) for _ in range(60)]
    return hit / total


@pytest.mark.parametrize("model_replies", [False, True])
def test_output_checkpoints_are_kept_only_where_replies_come_back(model_replies: bool) -> None:
    """Clients that re-send a rewritten reply never reuse an output checkpoint: the output
    kind learns it, its captures are skipped by value and tails stay resident; clients that
    re-send the model's reply do reuse it, and the output kind learns that."""
    cm = make(num_checkpoint_slots=3)
    rate = conversations(cm, n_conv=3, turns=40, model_replies=model_replies)
    s = cm.stats()
    assert rate > 0.9
    assert s["checkpoints.skipped_value"] > 0
    kinds = [n.policy_state.kind for n in cm.ckpts.residents if not n.policy_state.hits]
    if model_replies:
        assert s["checkpoints.reuse.output"] > 0.9
    else:
        assert s["checkpoints.reuse.output"] < 0.1 < 0.9 < s["checkpoints.reuse.tail"]
        assert CaptureKind.OUTPUT not in kinds


@pytest.mark.parametrize("model_replies", [False, True])
def test_cyclic_reuse_larger_than_the_pool_does_not_collapse(model_replies: bool) -> None:
    """5 conversations round-robin over 3 checkpoint slots: LRU-like rules thrash (every
    conversation's checkpoint is evicted just before it comes back); the value model keeps
    a stable subset and hits on it."""
    rates = {
        policy: conversations(
            make(num_checkpoint_slots=3, checkpoint_policy=policy), 5, 10, model_replies=model_replies
        )
        for policy in ("v1", "default")
    }
    assert rates["default"] >= 0.4
    assert rates["default"] >= 2 * rates["v1"]


def test_a_continuing_conversation_reuses_its_restore_source_slot() -> None:
    cm = make(num_checkpoint_slots=1)
    prompt = list(range(300))
    serve(cm, "t0", prompt, [7] * 3)
    (node,) = cm.ckpts.residents
    assert node.depth * 16 == 256
    evicted = cm.stats()["checkpoints.evicted"]
    nxt = prompt + list(range(5000, 5100))
    assert serve(cm, "t1", nxt, [7] * 3) == 256
    (node,) = cm.ckpts.residents
    assert node.depth * 16 == 384  # the new tail took the slot the restore was copied out of
    assert cm.stats()["checkpoints.evicted"] == evicted + 1
    assert cm.stats()["checkpoints.skipped_pool"] == 0


def test_kv_eviction_drops_dead_kv_first_then_the_least_valuable_checkpoint() -> None:
    cm = make(num_kv_blocks=64, num_checkpoint_slots=4)
    a, b = list(range(200)), list(range(1000, 1300))
    serve(cm, "a", a, [1])  # tail at 192
    serve(cm, "b", b, [2])  # tail at 256
    assert serve(cm, "a2", a + [5] * 40, [3]) == 192  # a's tail has served its turn (hit1)
    assert serve(cm, "b2", b + [6] * 40, [3]) == 256  # b's new tail at 320 is fresh
    depths = sorted(n.depth * 16 for n in cm.ckpts.residents)
    assert depths == [192, 256, 320]
    seq = cm.admit("big", list(range(9000, 9000 + 16 * 40)), b"x")
    assert seq is not None and cm.allocate(seq, 16 * 40)  # 12 blocks must go
    # first the dead KV past b2's tail and a2's prompt, then a's served checkpoint with
    # the chain it ended; b's checkpoints (on a live, shared path) stay
    assert cm.stats()["kv.evicted_blocks"] == 12
    assert sorted(n.depth * 16 for n in cm.ckpts.residents) == [256, 320]
    cm.free(seq, publish_output=False)
    cm.check_integrity()


def test_a_tracking_slot_gives_way_to_a_more_valuable_capture() -> None:
    cm = make(num_checkpoint_slots=1, num_live_slots=4)
    assert isinstance(cm.eviction, ValueEviction)
    cm.eviction.learner.track_time = 50.0  # outputs take long to be published here
    toks = list(range(60))  # no tail: the one slot goes to a's output
    a = cm.admit("a", toks, b"s")
    assert a is not None and cm.allocate(a, 60)
    cm.commit_step(cm.plan_step([StepItem(a, toks, 0, 60, False)]))
    for n in range(60, 130):  # crosses 64 and 128: the slot tracks a's output
        toks.append(n)
        assert cm.allocate(a, n + 1)
        cm.commit_step(cm.plan_step([StepItem(a, toks, n, n + 1, True)]))
    assert a.tracking_slot >= 0 and cm.ckpts.trackers == {a.tracking_slot: a}
    long = list(range(20_000, 24_000))  # a deep tail is worth more than a far-off short output
    b = cm.admit("b", long, b"s")
    assert b is not None and cm.allocate(b, len(long))
    plan = cm.plan_step([StepItem(b, long, 0, len(long), False)])
    assert [c.boundary for c in plan.captures] == [3968] and a.tracking_slot == -1
    cm.check_integrity()
    cm.commit_step(plan)
    cm.free(b)
    cm.free(a)
    cm.check_integrity()


def test_marginal_saving_counts_from_the_checkpoint_above() -> None:
    cm = make(num_checkpoint_slots=4)
    shared = list(range(1000))
    serve(cm, "a", shared + [1] * 30, [0])
    serve(cm, "b", shared + [2] * 30, [0])  # branch at 960 (shared), tail at 1024
    value = cm.eviction
    assert isinstance(value, ValueEviction)
    nodes = {n.depth * 16: n for n in cm.ckpts.residents}
    assert 960 in nodes and 1024 in nodes
    assert value._base(nodes[1024]) == 960
    assert value.saved(1024, 960) == pytest.approx(CostModel().saved(1024) - CostModel().saved(960))


def test_learner_credits_the_deepest_proposal_and_resolves_misses() -> None:
    learner = ReuseLearner(prior_hits=0.0, prior_misses=0.0)
    learner.register(11, CaptureKind.TAIL)
    learner.register(22, CaptureKind.OUTPUT)
    learner.register(33, CaptureKind.INTERVAL)
    # a path through 11 (boundary 1) and 33 (boundary 2): 33 is the deepest -> interval hit
    learner.observe([5, 11, 6, 33], limit_blocks=4, stride=2)
    assert learner.reuse_probability("interval") == 1.0
    assert sum(learner.proposed.hits[learner._index["tail"]]) == 0
    for _ in range(200):  # nobody comes back to 11 or 22: misses once their window passes
        learner.tick()
    assert learner.reuse_probability("tail") == 0.0 and learner.reuse_probability("output") == 0.0
    assert learner.proposed.misses[learner._index["tail"]] == 1


def _upper_and_output(
    upper_kind: CaptureKind,
) -> tuple[ReuseLearner, RadixTree, ValueEviction, Node, Node]:
    """A learner with no prior, and a chain root -> upper (``upper_kind``) -> output, each node
    valued by a ``ValueEviction`` over that learner."""
    learner = ReuseLearner(prior_hits=0.0, prior_misses=0.0)
    tree = RadixTree()
    value = ValueEviction(tree, EvictionParams(block_size=16), learner)
    upper = tree.insert(tree.root, 1, block_id=0)
    output = tree.insert(upper, 2, block_id=1)
    upper.policy_state = ValueState(upper_kind, None, 0, None)
    output.policy_state = ValueState(CaptureKind.OUTPUT, None, 0, None)
    return learner, tree, value, upper, output


def test_likely_to_serve_follows_the_learned_reuse_of_the_class() -> None:
    """The host's dominance test asks whether a checkpoint's class serves more often than not:
    a class whose proposals are credited answers yes, one whose proposals all expire no; the
    answer moves as the learner does (memoised per admission only)."""
    learner, tree, value, interval, output = _upper_and_output(CaptureKind.INTERVAL)
    learner.register(11, CaptureKind.INTERVAL)
    learner.register(22, CaptureKind.OUTPUT)
    learner.observe([5, 11], limit_blocks=2, stride=2)  # 11 comes back: an interval hit
    for _ in range(200):  # 22 never does: an output miss once its window passes
        learner.tick()
    assert value.likely_to_serve(interval) and not value.likely_to_serve(output)
    for key in range(100, 104):  # outputs start coming back
        learner.register(key, CaptureKind.OUTPUT)
        learner.observe([5, key], limit_blocks=2, stride=2)
    assert value.likely_to_serve(output)


def test_a_deeper_checkpoint_dominates_one_whose_class_serves_less_often() -> None:
    """Replies that come back verbatim after long, heavy-tailed waits: outputs are credited
    now and then (1 in 3 here, so not "more often than not"), the tails above them never (the
    deeper output takes the hit). The output still dominates its conversation's older tail,
    which the host then ranks first to go; where replies come back rewritten (tails credited,
    outputs never) it does not."""
    learner, tree, value, tail, output = _upper_and_output(CaptureKind.TAIL)
    tree.attach_checkpoint(output, 0)
    for key in (21, 22, 23):
        learner.register(key, CaptureKind.OUTPUT)
    for key in (31, 32):
        learner.register(key, CaptureKind.TAIL)
    learner.observe([5, 21], limit_blocks=2, stride=2)  # one output comes back
    for _ in range(200):  # the rest never do
        learner.tick()
    assert learner.reuse_probability("output") == pytest.approx(1 / 3)
    assert learner.reuse_probability("tail") == 0.0
    assert not value.likely_to_serve(output)  # not "more often than not" ...
    assert value.dominates(output, tail)  # ... but more often than the tail
    assert band(tail, value, tree) == DOMINATED
    for key in range(40, 46):  # tails start coming back, outputs do not (rewritten replies)
        learner.register(key, CaptureKind.TAIL)
        learner.observe([5, key], limit_blocks=2, stride=2)
    learner.tick()
    assert learner.reuse_probability("tail") > 1 / 3
    assert not value.dominates(output, tail)
    assert band(tail, value, tree) != DOMINATED


def test_learner_kept_shadow_teaches_hit_classes() -> None:
    learner = ReuseLearner(prior_hits=0.0, prior_misses=0.0)
    learner.kept_at(11, CaptureKind.BRANCH)
    for _ in range(3):
        learner.tick()
        learner.observe([11, 99], limit_blocks=2, stride=1)
    assert learner.reuse_probability("branch") == 1.0
    assert learner.reuse_probability("hit1") == 1.0 and sum(learner.kept.hits[learner._index["hit2"]]) == 1
    assert learner.density("hit2", 0) > learner.density("hit2", 1000) == 0.0


def test_buckets_partition_ages() -> None:
    for age in range(0, 5000):
        lo, hi = _bounds(_bucket(age))
        assert lo <= age < hi


def test_match_is_computed_once_per_index_version() -> None:
    cm = make()
    serve(cm, "a", list(range(300)), [1])
    calls = 0
    real = cm.kv.match

    def counting(*args: object, **kw: object) -> PrefixMatch:
        nonlocal calls
        calls += 1
        return real(*args, **kw)  # type: ignore[arg-type]

    cm.kv.match = counting  # type: ignore[method-assign]
    prompt, hashes = list(range(300)) + [9] * 10, []
    first = cm.match(prompt, b"s", hashes, key="r")
    assert lookup(cm, prompt, b"s", hashes, key="r") == first.hit_tokens == 256
    seq = cm.admit("r", prompt, b"s", hashes=hashes, match=first)
    assert calls == 1 and seq is not None and seq.num_cached_tokens == 256
    cm.free(seq)
    cm.match(prompt, b"s", hashes, key="r2")
    cm.kv.tree.version += 1  # the index moved on: matched again
    cm.match(prompt, b"s", hashes, key="r2")
    assert calls == 3


def forget_history(learner: ReuseLearner) -> None:
    """The ablation: ``learner`` still learns, but every request's path history is unknown."""
    observe = learner.observe
    learner.observe = lambda *a: (observe(*a), None)[1]  # type: ignore[method-assign]


def test_learner_separates_paths_by_history() -> None:
    """Conversations of exactly 3 turns: a tail proposed on a path with 0 or 1 earlier
    proposals is reused (the next turn comes), one with 2 never is (the conversation is
    over). The history classes learn it; the kind's report covers all of them."""
    learner = ReuseLearner(prior_hits=0.0, prior_misses=0.0)
    for c in range(0, 60, 4):  # 4 conversations at a time, round-robin
        paths = [[1000 * (c + k) + i for i in range(6)] for k in range(4)]
        for turn in range(3):
            for path in paths:
                top = 2 * (turn + 1)
                assert learner.observe(path[:top], limit_blocks=top, stride=1) == turn
                learner.register(path[top - 1], CaptureKind.TAIL, turn)
    for _ in range(200):
        learner.tick()
    assert learner.reuse_probability("tail") == pytest.approx(2 / 3)
    # 15 paths each, shrunk toward the kind's 2/3 by 4 pseudo-entries
    assert learner.reuse_probability("tail@1") == pytest.approx((15 + 4 * 2 / 3) / 19)
    assert learner.reuse_probability("tail@2") == pytest.approx(4 * 2 / 3 / 19)
    assert learner.density("tail@2", 0) < 0.2 * learner.density("tail@1", 0)
    # the ages are the kind's: a history class only scales how likely a hit is
    assert learner.density("tail@1", 3) / learner.density("tail@1", 0) == pytest.approx(
        learner.density("tail", 3) / learner.density("tail", 0)
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_a_finished_conversations_last_tail_goes_first(seed: int) -> None:
    """Conversations of 4 turns arrive one after another, 4 live at a time over 3 slots.
    Each conversation's last tail is its deepest (worth the most tokens) and is never used
    again; a tail on a path with fewer turns behind it will be. With the history classes the
    value model evicts the finished conversations' tails first and hits more than without."""

    def run(history: bool) -> float:
        cm = make(num_checkpoint_slots=3)
        if not history:
            forget_history(cm.eviction.learner)  # type: ignore[attr-defined]
        rng = random.Random(seed)
        hit = total = 0
        live: list[tuple[int, list[int], int]] = []  # (conversation, prompt, turns done)
        for c in range(40):
            live.append((c, [100_000 * (c + 1) + i for i in range(200 + rng.randrange(200))], 0))
            while len(live) >= 4 or (c == 39 and live):
                conv, prompt, done = live.pop(0)
                h = serve(cm, f"c{conv}t{done}", prompt, [7] * 8)
                if done:
                    hit, total = hit + h, total + len(prompt)
                if done < 3:
                    extra = [rng.randrange(60_000, 70_000) for _ in range(100)]
                    live.insert(rng.randrange(len(live) + 1), (conv, prompt + extra, done + 1))
        return hit / total

    with_history, without = run(True), run(False)
    assert with_history > without + 0.1, (with_history, without)


@pytest.mark.parametrize("user", [120, 160])
def test_history_changes_nothing_where_every_history_is_reused_alike(user: int) -> None:
    """8 conversations in lock-step over 3 slots, a shared system prompt, half of them
    re-sending the model's reply: every turn's captures start a new history at once. A
    history class only scales its kind's reuse (it does not bring ages of its own), so
    residents and newcomers are still ranked on one age curve: no churn, and the hit rate
    is the one without history classes."""

    def run(history: bool) -> float:
        cm = make(num_checkpoint_slots=3, num_kv_blocks=352)
        if not history:
            forget_history(cm.eviction.learner)  # type: ignore[attr-defined]
        rng = random.Random(0)
        system = list(range(1, 151))
        prompts = [system + [1000 * (c + 1) + i for i in range(user)] for c in range(8)]
        hit = total = 0
        for t in range(6):
            for c in range(8):
                reply = [rng.randrange(50_000, 60_000) for _ in range(24)]
                h = serve(cm, f"c{c}t{t}", prompts[c], reply)
                if t:
                    hit, total = hit + h, total + len(prompts[c])
                resent = reply if c % 2 else reply[len(reply) * 7 // 10 :]
                prompts[c] = (
                    prompts[c] + [9, *resent, 8] + [rng.randrange(70_000, 80_000) for _ in range(user)]
                )
        return hit / total

    with_history, without = run(True), run(False)
    assert with_history >= without - 0.02 and with_history > 0.2, (with_history, without)


def test_a_branching_checkpoint_does_not_age_while_requests_run_below_it() -> None:
    """A tree search's parent: continuations fork at 288 tokens (the branch checkpoint is at
    256), two of them still decoding. While they run, the branch checkpoint keeps the value
    of a fresh one (it is the fallback of whichever child is continued); with one left it
    ages again and, past every reuse age seen, it is worth nothing."""
    cm = make()
    value = cm.eviction
    assert isinstance(value, ValueEviction)
    shared = list(range(300))
    serve(cm, "a", shared + list(range(1000, 1100)), [7] * 3)
    serve(cm, "b", shared + list(range(2000, 2100)), [7] * 3)
    (branch,) = [n for n in cm.ckpts.residents if n.depth * 16 == 256]  # the fork is at 288
    running = []
    for rid, k in (("c", 3000), ("d", 4000)):  # prefilled: each publishes its blocks below the fork
        toks = shared + list(range(k, k + 100))
        seq = cm.admit(rid, toks, b"s")
        assert seq is not None and cm.allocate(seq, len(toks))
        cm.commit_step(cm.plan_step([StepItem(seq, toks, seq.num_cached_tokens, len(toks), False)]))
        running.append(seq)
    assert branch.ref_count == 2
    fresh = value.value(branch)
    for _ in range(200):
        value.learner.tick()
    assert value.value(branch) == fresh > 0
    cm.free(running[0])
    assert value.value(branch) == 0.0
    cm.free(running[1])
    cm.check_integrity()


def test_a_checkpoint_a_waiting_request_will_restore_from_is_kept() -> None:
    """The same eviction as above with a waiting request about to restore from a's served
    checkpoint (``expect_hits``): that hit is certain, one admission away, so a's chain stays
    and b's go instead; once no request waits for it, it is priced by its class again."""
    cm = make(num_kv_blocks=64, num_checkpoint_slots=4)
    value = cm.eviction
    assert isinstance(value, ValueEviction)
    a, b = list(range(200)), list(range(1000, 1300))
    serve(cm, "a", a, [1])
    serve(cm, "b", b, [2])
    assert serve(cm, "a2", a + [5] * 40, [3]) == 192
    assert serve(cm, "b2", b + [6] * 40, [3]) == 256
    (served,) = [n for n in cm.ckpts.residents if n.depth * 16 == 192]
    before = value.value(served)
    value.expect_hits({served: 1})
    boosted = value.value(served)
    assert boosted > before and boosted >= value.saved(192, 0) / (value.bytes + value.kv_block_bytes * 12)
    seq = cm.admit("big", list(range(9000, 9000 + 16 * 40)), b"x")
    assert seq is not None and cm.allocate(seq, 16 * 40)
    assert cm.stats()["kv.evicted_blocks"] == 12
    # on the old value it was a's chain that went: [256, 320] (the test above)
    assert sorted(n.depth * 16 for n in cm.ckpts.residents) == [192]
    value.expect_hits({})
    assert value.value(served) < boosted
    cm.free(seq, publish_output=False)
    cm.check_integrity()


def test_a_capture_displaces_the_older_tail_a_decoding_turns_tail_dominates() -> None:
    """Two turns of one conversation: an older tail, and below it the newer turn's tail with
    its reply's KV below that. Valued over the older tail, the newer tail is the weakest
    resident; but the older one is the next to go anyway (the newer dominates it), so a more
    valuable capture takes the older tail's slot and the conversation keeps its deepest
    fallback. Without KV below it (between turns) the weakest itself still goes."""
    learner = ReuseLearner()
    tree = RadixTree()
    value = ValueEviction(tree, EvictionParams(block_size=16), learner)
    older = tree.root
    for key in range(1, 41):
        older = tree.insert(older, key, block_id=key)
    newer = older
    for key in range(41, 45):
        newer = tree.insert(newer, key, block_id=key)
    tree.attach_checkpoint(older, 0)
    tree.attach_checkpoint(newer, 1)
    older.policy_state = ValueState(CaptureKind.TAIL, None, 0, None)
    newer.policy_state = ValueState(CaptureKind.TAIL, None, 0, older)
    assert value.value(newer) < value.value(older)  # 4 blocks over the older tail, 40 over nothing
    assert value.dominates(newer, older)
    want = Want(CaptureKind.TAIL, boundary=16 * 200)
    assert value.victim(want, [older, newer]) == (newer, "")  # between turns: the weakest goes
    tree.insert(newer, 45, block_id=45)  # the newer turn decodes its reply below its tail
    assert value.victim(want, [older, newer]) == (older, "")
    value.expect_hits({older: 1})  # a waiting request restores from the older tail: it stays
    assert value.victim(want, [older, newer]) == (newer, "")
