"""A commit that raises at any point leaves the cache whole, and it goes on serving.

Each case raises once, on the k-th call (for every k) of one method that ``commit_step``
or its helpers call, during a run of prompts that reaches every piece of a commit: copies
between tiers landing (saves, KV loads, a host restore), restores released, blocks
published (inserted, shared, promoted from the host) and captures attached or freed as
duplicates. The run recovers the way the engine does (``abort_step`` of what the plan
still holds, the step's requests freed); ``check_integrity()`` holds after every step, and
the same prompts then serve again, with hits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from deltaserve.cache import CacheManager, CacheManagerConfig, StepItem

from .helpers import lookup


class Injected(RuntimeError):
    """The fault a test injects."""


def _device() -> CacheManager:
    return CacheManager(
        CacheManagerConfig(
            block_size=16, num_kv_blocks=64, num_live_slots=4, num_checkpoint_slots=8, checkpoint_bytes=100
        )
    )


def _two_tier() -> CacheManager:
    cfg = CacheManagerConfig(
        block_size=16, num_kv_blocks=8, num_live_slots=2, num_checkpoint_slots=1, checkpoint_bytes=300,
        kv_block_bytes=100, num_host_kv_blocks=32, num_host_checkpoint_slots=4,
    )  # fmt: skip
    return CacheManager(cfg)


SHARED = list(range(5000, 5200))
DEVICE_BATCHES = [
    [list(range(300))],
    # a restore from the first prompt's tail; two identical prompts: one inserts, one shares
    [list(range(300)) + list(range(900, 1000)), SHARED, list(SHARED)],
]
CONVO = list(range(100))
TWO_TIER_BATCHES = [
    [CONVO],
    [[7] * 120],  # evicts the conversation: demoted (its saves land in this commit)
    [CONVO + [5, 6, 7]],  # a host hit: its loads land
    [[8] * 120],  # demotes it again
    [CONVO[:64]],  # no hit (a checkpoint ends it): computing it promotes its host blocks
]

DEVICE_POINTS = [
    ("ckpts", "release_restore"), ("ckpts", "unpin_source"), ("eviction", "on_unpin"),
    ("kv", "publish"), ("tree", "insert"), ("tree", "pin"), ("tree", "touch"), ("blocks", "free"),
    ("kv", "node_at"), ("ckpts", "attach"), ("tree", "attach_checkpoint"), ("slots", "set_state"),
    ("eviction", "on_attach"), ("slots", "free_checkpoint"),
]  # fmt: skip
TWO_TIER_POINTS = [
    ("load_queue", "land"), ("host", "save_landed"), ("tree", "set_moving"), ("host", "release_block"),
    ("ckpts", "unpin_source"), ("tree", "set_ckpt_moving"), ("kv", "publish"), ("tree", "promote"),
    ("tree", "insert"), ("tree", "pin"), ("ckpts", "attach"),
]  # fmt: skip


def _inject(cm: CacheManager, part: str, method: str, k: int | None) -> list[int]:
    """Raise ``Injected`` on the k-th call of ``cm.<part>.<method>`` made inside a commit
    (None: never); the returned list counts those calls."""
    calls = [0]
    inside = [False]
    obj = getattr(cm, part)
    real: Callable[..., Any] = getattr(obj, method)

    def faulty(*args: Any, **kwargs: Any) -> Any:
        if inside[0]:
            calls[0] += 1
            if calls[0] == k:
                raise Injected(f"{part}.{method} call {k}")
        return real(*args, **kwargs)

    commit = cm.commit_step

    def commit_step(plan: Any) -> None:
        inside[0] = True
        try:
            commit(plan)
        finally:
            inside[0] = False

    setattr(obj, method, faulty)
    cm.commit_step = commit_step  # type: ignore[method-assign]
    return calls


Running = dict[str, tuple[Any, list[int]]]  # request id -> (its SeqCache, its prompt)
Results = dict[str, tuple[str, int]]  # request id -> (outcome, hit tokens at admission)


def _serve(cm: CacheManager, batches: Sequence[Sequence[list[int]]]) -> Results:
    """Serve each batch to its end (one whole prefill step per request, after its loads);
    the outcome of every request. Integrity is checked after every step."""
    results: Results = {}
    for b, batch in enumerate(batches):
        waiting = [(f"{b}.{i}", toks) for i, toks in enumerate(batch)]
        running: Running = {}
        for _ in range(50):
            if not waiting and not running:
                break
            _admit(cm, waiting, running, results)
            _step(cm, running, results)
            cm.check_integrity()
        assert not waiting and not running, "the run got stuck"
    return results


def _admit(
    cm: CacheManager, waiting: list[tuple[str, list[int]]], running: Running, results: Results
) -> None:
    while waiting:
        rid, toks = waiting[0]
        seq = cm.admit(rid, toks, b"s")
        if seq is None:
            return
        cm.record_query(len(toks), seq.num_cached_tokens, seq)
        running[rid] = (seq, toks)
        results[rid] = ("running", seq.num_cached_tokens)
        waiting.pop(0)


def _step(cm: CacheManager, running: Running, results: Results) -> None:
    """One step: the requests whose loads have landed compute their whole prompt and end;
    a commit that raises is recovered as the engine does (its requests end with an error)."""
    items = []
    for seq, toks in running.values():
        if seq.loads:
            cm.stage_loads(seq)
        elif cm.allocate(seq, len(toks)):
            items.append(StepItem(seq, toks, seq.num_cached_tokens, len(toks), False))
    plan = cm.plan_step(items)
    try:
        cm.commit_step(plan)
        outcome = "ok"
    except Injected:
        if cm.in_flight(plan):
            cm.abort_step(plan)
        outcome = "error"
    for item in items:
        seq = item.seq
        cm.free(seq, publish_output=outcome == "ok")
        del running[seq.request_id]
        results[seq.request_id] = (outcome, results[seq.request_id][1])


# (name, manager, batches, a prompt that hits once they are served, fault points)
SCENARIOS = [
    ("device", _device, DEVICE_BATCHES, DEVICE_BATCHES[1][0], DEVICE_POINTS),
    ("two_tier", _two_tier, TWO_TIER_BATCHES, CONVO + [5, 6, 7], TWO_TIER_POINTS),
]


@pytest.mark.parametrize(
    ("make", "batches", "probe", "point"),
    [
        pytest.param(m, b, probe, p, id=f"{name}-{p[0]}.{p[1]}")
        for name, m, b, probe, points in SCENARIOS
        for p in points
    ],
)
def test_commit_that_raises_at_any_point_leaves_the_cache_whole(
    make: Callable[[], CacheManager],
    batches: list[list[list[int]]],
    probe: list[int],
    point: tuple[str, str],
) -> None:
    dry = make()
    calls = _inject(dry, *point, None)
    clean = _serve(dry, batches)
    assert all(outcome == "ok" for outcome, _ in clean.values())
    assert calls[0] > 0, "the run never reaches this point of a commit"
    for k in range(1, calls[0] + 1):
        cm = make()
        faulty = _inject(cm, *point, k)
        _serve(cm, batches)
        assert faulty[0] >= k, f"call {k}: no commit raised"
        # the cache serves on: the same prompts again, all of them, the later ones with hits
        again = _serve(cm, batches)
        assert all(outcome == "ok" for outcome, _ in again.values()), f"call {k}"
        assert any(hit > 0 for _, hit in again.values()), f"call {k}"
        assert lookup(cm, probe, b"s") > 0, f"call {k}"
        cm.check_integrity()
