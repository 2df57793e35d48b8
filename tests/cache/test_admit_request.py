"""CacheManager.admit_request: the scheduler's one admission call, and the parts wired at construction."""

from __future__ import annotations

from deltaserve.cache import CacheManager, StepItem
from deltaserve.cache.types import Admission, AdmitStatus

from .test_disk_tier import DictStore, manager
from .test_manager import make, run_prefill


def admit(cm: CacheManager, rid: str, toks: list[int], end: int | None, **kw: object) -> Admission:
    """``admit_request`` with a first chunk ending at ``end`` (None: no chunk fits)."""
    m = cm.match(toks, b"s", key=rid)
    seen: list[int] = []

    def first_chunk(hit: int) -> int | None:
        seen.append(hit)
        return end

    a = cm.admit_request(rid, toks, b"s", m, first_chunk, prompt_len=len(toks), hashes=m.hashes, **kw)  # type: ignore[arg-type]
    assert seen in ([], [m.hit_tokens])  # the chunk is asked once, from the match's hit
    return a


def test_admitted_holds_blocks_for_its_first_chunk_and_counts_its_query_once() -> None:
    cm = make()
    toks = list(range(100))
    run_prefill(cm, "a", toks[:64] + [999] * 4)  # publishes 64 tokens with a tail checkpoint
    a = admit(cm, "b", toks, 96)
    assert a.status is AdmitStatus.ADMITTED and a.seq is not None
    assert (a.start, a.end) == (64, 96)
    assert len(a.seq.block_table) * cm.block_size >= 96
    stats = cm.stats()
    assert stats["prefix_cache.queries"] == 1 and stats["prefix_cache.hit_tokens"] == 64
    cm.check_integrity()


def test_no_chunk_holds_nothing_and_counts_nothing() -> None:
    cm = make()
    a = admit(cm, "a", list(range(40)), None)
    assert a == Admission(AdmitStatus.NO_FIT)
    assert cm.active == {} and cm.stats()["prefix_cache.queries"] == 0
    cm.check_integrity()


def test_no_blocks_for_the_first_chunk_undoes_the_admission() -> None:
    cm = make(num_kv_blocks=4)
    a = admit(cm, "a", list(range(200)), 160)  # 10 blocks of 16 > 4
    assert a.status is AdmitStatus.NO_FIT and a.seq is None
    assert cm.active == {} and cm.blocks.num_free == 4 and cm.num_free_live_slots == 4
    assert cm.stats()["prefix_cache.queries"] == 0
    cm.check_integrity()


def test_a_recompute_counts_no_query_but_its_hit_against_the_preemption() -> None:
    cm = make()
    toks = list(range(100))
    run_prefill(cm, "a", toks[:64] + [999] * 4)
    a = admit(cm, "b", toks, 96, preempted_tokens=80)
    assert a.status is AdmitStatus.ADMITTED
    # run_prefill admits with ``admit`` (no query); a recompute counts none either
    assert cm.stats()["prefix_cache.queries"] == 0
    cm.check_integrity()


def test_host_hit_is_admitted_loading_with_its_loads_staged() -> None:
    cm = make(num_kv_blocks=8, num_host_kv_blocks=32, num_host_checkpoint_slots=8)
    toks = list(range(16 * 6 + 3))
    run_prefill(cm, "a", toks)
    run_prefill(cm, "x", [7000 + i for i in range(16 * 7)])  # pushes a's blocks to the host
    a = admit(cm, "b", toks, len(toks))
    assert a.status is AdmitStatus.LOADING and a.seq is not None and a.seq.loads
    assert a.seq.host_hit_tokens > 0 and a.start == a.end == a.seq.num_cached_tokens
    assert all(t.staged for t in a.seq.loads[:1]) and cm.has_transfers()
    plan = cm.plan_step([])
    cm.commit_step(plan)
    cm.check_integrity()


def test_the_disk_tier_plugs_into_one_socket_every_part_holds_from_construction() -> None:
    cm = manager(DictStore())
    tier = cm.disk
    assert tier is not None and cm.disk_link.tier is tier
    # the checkpoint store, the host tier and the tier moves hold the same link from construction
    assert cm.ckpts.disk is cm.disk_link and cm.host.disk is cm.disk_link and cm.tiers.disk is cm.disk_link
    toks = list(range(64 * 2 + 5))
    seq = cm.admit("a", toks, b"s")
    assert seq is not None and cm.allocate(seq, 128)
    cm.commit_step(cm.plan_step([StepItem(seq, toks, 0, 128, False)]))
    cm.free(seq)
    published = len(tier.pending)
    assert published > 0  # a published checkpoint reached the tier through the link
    cm.detach_disk()
    assert cm.disk is None and cm.disk_link.tier is None and cm.ckpts.disk is cm.disk_link
    seq = cm.admit("b", [5000 + t for t in toks], b"s")
    assert seq is not None and cm.allocate(seq, 128)
    cm.commit_step(cm.plan_step([StepItem(seq, [5000 + t for t in toks], 0, 128, False)]))
    cm.free(seq)
    assert len(tier.pending) == published  # detached: nothing more reaches it
    cm.check_integrity()
